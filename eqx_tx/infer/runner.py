"""The engine's device side: the page pool, each slot's next-token logits, and the
jitted steps that execute a `StepPlan` (`eqx_tx.infer.scheduler`)."""

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from ..cache.allocate import new_paged_cache
from ..core.compute import ComputeConfig
from ..core.distributed import to_host
from ..core.sharding import commit, current_mesh, mesh_context
from ..models import CausalLM
from .sampling import SamplerArrays, SamplingParams
from .scheduler import DecodeBatch, PrefillBatch
from .steps import paged_decode_step, paged_prefill_chunk, zero_logits


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

    def prefill(self, batch: PrefillBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Write one chunk of each planned context into the pool; a context that ends in
        it sets its slot's next-token logits. Returns the scores of the positions
        `batch.targets` names (host arrays, `[P, C]`, `[P, C, top_k]` twice), or `None`."""
        with mesh_context(self.model):
            self.cache, self.logits, scores = paged_prefill_chunk(
                self.model, self.cache, self.logits, jnp.asarray(batch.rows), jnp.asarray(batch.table),
                jnp.asarray(batch.tokens), jnp.asarray(batch.start), jnp.asarray(batch.length),
                _maybe(batch.adapters), _maybe(batch.targets), compute=self.compute, top_k=batch.top_k,
            )
        if scores is None:
            return None
        logp, top_ids, top_logp = scores
        return to_host(logp), to_host(top_ids), to_host(top_logp)

    def decode(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """Sample one token for every planned row and feed it. Returns the tokens and
        their log-probs (host arrays, one per row), and the most likely alternatives'
        ids and log-probs (`[rows, top_logprobs]` each; `None` without)."""
        params = [r.params for r in batch.requests]
        samples = [r.sample for r in batch.requests]
        with mesh_context(self.model):
            self.cache, self.logits, token, logp, top_ids, top_logp = paged_decode_step(
                self.model, self.cache, self.logits, jnp.asarray(batch.rows), jnp.asarray(batch.table),
                jnp.asarray(batch.positions), jnp.asarray(batch.generated), _maybe(batch.adapters),
                self._sampler_arrays(batch.sampler_key, params, samples, len(batch.rows)), compute=self.compute,
                top_logprobs=self.top_logprobs,
            )
        top = None if top_ids is None or top_logp is None else (to_host(top_ids), to_host(top_logp))
        return to_host(token), to_host(logp), top

    def warmup(self, prefill_shapes: list[tuple[int, int]], decode_rows: list[int], bank: bool,
               progress: Callable[[int, int], object] | None = None, score_top_ks: Sequence[int] = ()) -> None:
        """Compile every `(chunk, rows)` prefill (and, for each of `score_top_ks`, that
        prefill scoring its positions with that many alternatives) and every decode row
        count now, on inputs whose writes are dropped (out-of-range slots, unallocated
        pages). `progress(done, total)` is called after each shape."""
        unallocated = np.full((1, self.pages_per_seq), self.num_pages, np.int32)
        adapters = (lambda n: np.zeros((n,), np.int32)) if bank else (lambda n: None)
        prefills = [(C, P, None) for C, P in prefill_shapes] + [(C, P, k) for k in score_top_ks
                                                                   for C, P in prefill_shapes]
        total, done = len(prefills) + len(decode_rows), 0
        for C, P, k in prefills:
            self.prefill(PrefillBatch(np.full((P,), self.max_seqs, np.int32), np.repeat(unallocated, P, axis=0),
                                      np.zeros((P, C), np.int32), np.zeros((P,), np.int32), np.ones((P,), np.int32),
                                      adapters(P), targets=None if k is None else np.full((P, C), -1, np.int32),
                                      top_k=k or 0))
            done += 1
            if progress is not None:
                progress(done, total)
        for R in decode_rows:
            self.decode(DecodeBatch((), np.full((R,), self.max_seqs, np.int32), np.repeat(unallocated, R, axis=0),
                                    np.zeros((R,), np.int32), np.zeros((R,), np.int32), adapters(R)))
            done += 1
            if progress is not None:
                progress(done, total)

    def _sampler_arrays(self, key: tuple, params: list[SamplingParams], samples: list[int], rows: int) -> SamplerArrays:
        if self._sampler is None or self._sampler[0] != key:
            params = params + [SamplingParams()] * (rows - len(params))
            samples = samples + [0] * (rows - len(samples))
            # Stops are checked on the host (the scheduler): no stop ids on the device (one shape for all).
            params = [dataclasses.replace(p, stop_token_ids=()) for p in params]
            self._sampler = key, SamplerArrays.from_params(params, (), self.model.config.vocab_size, samples)
        return self._sampler[1]


def _maybe(x: np.ndarray | None):
    return None if x is None else jnp.asarray(x)
