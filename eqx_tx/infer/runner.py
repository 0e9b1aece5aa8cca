"""The engine's device side: the page pool, each slot's next-token logits, and the
jitted steps that execute a `StepPlan` (`eqx_tx.infer.scheduler`)."""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ..cache.allocate import new_paged_cache
from ..core.compute import ComputeConfig
from ..core.distributed import to_host
from ..core.sharding import commit, current_mesh, mesh_context
from ..models import CausalLM
from .sampling import SamplerArrays, SamplingParams
from .scheduler import DecodeBatch, PrefillBatch
from .steps import paged_decode_step, paged_mixed_step, paged_prefill_chunk, zero_logits

Scores = tuple[np.ndarray, np.ndarray, np.ndarray]
Sampled = tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]
OnDevice = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]  # a decode step's outputs, not yet read


class Runner:
    """Executes planned steps on a model over one page pool.

    **Arguments:** the model; the pool's `num_pages` pages of `page_size` tokens
    (`dtype`: its storage dtype); `max_seqs` slots of up to `pages_per_seq` pages;
    `compute`: how the model runs; `top_logprobs`: alternatives reported per token.
    """

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int, max_seqs: int, pages_per_seq: int, dtype,
                 compute: ComputeConfig, top_logprobs: int = 0):
        self.model, self.compute, self.max_seqs, self.top_logprobs = model, compute, max_seqs, top_logprobs
        self.num_pages, self.pages_per_seq = num_pages, pages_per_seq
        with mesh_context(model):
            cache = new_paged_cache(model.config, pages=num_pages, page_size=page_size, batch=max_seqs,
                                    pages_per_seq=pages_per_seq, dtype=dtype, mesh=current_mesh())
            # Committed, as the steps return them: the first step compiles for the shapes that every later one uses.
            self.cache, self.logits = commit((cache, zero_logits(max_seqs, model.config.vocab_size)))
        self._sampler: tuple[tuple, SamplerArrays] | None = None  # (running ids, rows) -> their sampler

    def prefill(self, batch: PrefillBatch) -> Scores | None:
        """Write one chunk of each planned context into the pool; a context that ends in
        it sets its slot's next-token logits. Returns the scores of the positions
        `batch.targets` names (host arrays, `[P, C]`, `[P, C, top_k]` twice), or `None`."""
        with mesh_context(self.model):
            self.cache, self.logits, scores = paged_prefill_chunk(
                self.model, self.cache, self.logits, *_prefill_arrays(batch), batch.adapters,
                batch.targets, compute=self.compute, top_k=batch.top_k,
            )
        return _scores(scores)

    def decode(self, batch: DecodeBatch) -> OnDevice:
        """Sample one token for every planned row and feed it. Returns, on the device and
        possibly not yet computed (`fetch` reads them), the tokens and their log-probs
        (one per row), and the most likely alternatives' ids and log-probs
        (`[rows, top_logprobs]` each; `None` without)."""
        with mesh_context(self.model):
            self.cache, self.logits, *sampled = paged_decode_step(
                self.model, self.cache, self.logits, *_decode_arrays(batch), batch.adapters,
                self._sampler_for(batch), compute=self.compute, top_logprobs=self.top_logprobs,
                share_rows=batch.share_rows,
            )
        return tuple(sampled)  # type: ignore[return-value]

    @staticmethod
    def fetch(sampled: OnDevice) -> Sampled:
        """A decode step's outputs (`decode`) as host arrays, once they are computed."""
        token, logp, top_ids, top_logp = sampled
        top = None if top_ids is None or top_logp is None else (to_host(top_ids), to_host(top_logp))
        return to_host(token), to_host(logp), top

    def mixed(self, prefill: PrefillBatch, decode: DecodeBatch) -> tuple[Scores | None, OnDevice]:
        """`prefill` and `decode` in one pass through the model (`paged_mixed_step`);
        returns what `prefill` and `decode` return."""
        adapters = None if prefill.adapters is None or decode.adapters is None else \
            np.concatenate([prefill.adapters, decode.adapters])
        with mesh_context(self.model):
            self.cache, self.logits, *sampled, scores = paged_mixed_step(
                self.model, self.cache, self.logits, _prefill_arrays(prefill), _decode_arrays(decode),
                adapters, self._sampler_for(decode), prefill.targets, compute=self.compute,
                top_k=prefill.top_k, top_logprobs=self.top_logprobs,
            )
        return _scores(scores), tuple(sampled)  # type: ignore[return-value]

    def warmup(self, prefill_shapes: list[tuple[int, int]], decode_rows: list[int], bank: bool,
               progress: Callable[[int, int], object] | None = None, score_top_ks: Sequence[int] = (),
               mixed: bool = False, share_rows: int = 0) -> None:
        """Compile every `(chunk, rows)` prefill (and, for each of `score_top_ks`, that
        prefill scoring its positions with that many alternatives; with `mixed`, each in
        one pass with `max_seqs` decode rows) and every decode row count (with
        `share_rows > 1`, also in runs of that many rows where they divide it) now, on
        inputs whose writes are dropped (out-of-range slots, unallocated pages).
        `progress(done, total)` is called after each shape."""
        unallocated = np.full((1, self.pages_per_seq), self.num_pages, np.int32)
        adapters = (lambda n: np.zeros((n,), np.int32)) if bank else (lambda n: None)

        def decode_batch(R, share=0):
            return DecodeBatch((), np.full((R,), self.max_seqs, np.int32), np.repeat(unallocated, R, axis=0),
                               np.zeros((R,), np.int32), np.zeros((R,), np.int32), adapters(R), share_rows=share)

        prefills = [(C, P, None) for C, P in prefill_shapes] + [(C, P, k) for k in score_top_ks
                                                                   for C, P in prefill_shapes]
        decodes = [(R, 0) for R in decode_rows] + [(R, share_rows) for R in decode_rows
                                                   if share_rows > 1 and R % share_rows == 0]
        total, done = len(prefills) + len(decodes), 0
        for C, P, k in prefills:
            batch = PrefillBatch(np.full((P,), self.max_seqs, np.int32), np.repeat(unallocated, P, axis=0),
                                 np.zeros((P, C), np.int32), np.zeros((P,), np.int32), np.ones((P,), np.int32),
                                 adapters(P), targets=None if k is None else np.full((P, C), -1, np.int32),
                                 top_k=k or 0)
            if mixed:
                self.mixed(batch, decode_batch(self.max_seqs))
            else:
                self.prefill(batch)
            done += 1
            if progress is not None:
                progress(done, total)
        for R, share in decodes:
            self.fetch(self.decode(decode_batch(R, share)))
            done += 1
            if progress is not None:
                progress(done, total)

    def _sampler_for(self, batch: DecodeBatch) -> SamplerArrays:
        """The sampler of `batch`'s rows (kept while the same requests run in the same rows)."""
        key, rows = batch.sampler_key, len(batch.rows)
        if self._sampler is None or self._sampler[0] != key:
            params, samples = [SamplingParams()] * rows, [0] * rows  # padding rows
            for i, r in zip(batch.row_of(), batch.requests):
                params[i], samples[i] = r.params, r.sample
            # Stops are checked on the host (the scheduler): no stop ids on the device (one shape for all).
            params = [dataclasses.replace(p, stop_token_ids=()) for p in params]
            self._sampler = key, SamplerArrays.from_params(params, (), self.model.config.vocab_size, samples)
        return self._sampler[1]


# The plans' host arrays go to the jitted steps as they are: jit moves numpy arguments
# to the device itself, faster than `jnp.asarray` does one by one (~0.1 ms each).
def _prefill_arrays(batch: PrefillBatch) -> tuple:
    return batch.rows, batch.table, batch.tokens, batch.start, batch.length


def _decode_arrays(batch: DecodeBatch) -> tuple:
    return batch.rows, batch.table, batch.positions, batch.generated


def _scores(scores) -> Scores | None:
    return None if scores is None else tuple(to_host(x) for x in scores)  # type: ignore[return-value]
