"""A sampling engine: a paged KV cache and continuous batching.

`generate` runs a static batch: every request gets a cache row of the longest
`prompt + max_new_tokens`, and nothing new starts until the slowest one ends.
`Engine` keeps `max_seqs` decode slots over one pool of KV pages
(`eqx_tx.cache.paged`). It is two parts: a `Scheduler` (`eqx_tx.infer.scheduler`)
that admits, preempts and plans each step on the host, and a `Runner`
(`eqx_tx.infer.runner`) that executes the plan's prefill chunk and decode step on
the device, one after the other or in one pass through the model
(`EngineConfig.mixed_steps`). Each `step()` plans a step and launches it, then
records the tokens of the step before it (`EngineConfig.overlap_steps`: the host's
planning and bookkeeping run while the device computes; off: each step's own).

A finished request's slot and pages go to the next waiting request at once (its
full pages stay cached until the space is needed). With a LoRA adapter bank
(`apply_lora(..., adapters=n)`) each request names its adapter, rows of one batch
use different adapters, and cached pages are shared only between requests of the
same adapter. Each request's tokens and log-probs equal `generate` on that
request alone: the sampler draws token `i` with the request's own key
(`SamplingParams.seed`), and attention reads exactly the request's own positions.
"""

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..core.compute import ComputeConfig
from ..core.log import log_once
from ..core.sharding import RULES, current_mesh, mesh_axis_size, mesh_context
from ..core.util import ceil_div
from ..kernels.dispatch import target_platform
from ..layers.lora import check_adapter_ids, has_bank, set_adapter_slot
from ..models import CausalLM
from .config import EngineConfig
from .runner import OnDevice, Runner
from .sampling import SamplingParams
from .scheduler import DecodeBatch, Scheduler, StepPlan, TokenEvent
from .steps import Generation, check_requests

__all__ = ["Engine", "EngineConfig", "TokenEvent"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


class Engine:
    """Continuous batching over a paged KV cache.

    **Arguments:**

    - `model`: the model (possibly sharded over `tp`: the pool's kv heads follow it).
    - `config`: the engine's settings (`EngineConfig`: slots, pool size, page size,
      prefill chunk and rows, longest request, pool dtype); any of its fields may also
      be given as a keyword (`max_seqs=...`), overriding it.
    - `cache_dtype`: the pool's dtype as a dtype (`None`: `config.kv_cache_dtype`).
    - `compute`: attention implementation etc.
    """

    def __init__(self, model: CausalLM, config: EngineConfig | None = None, *, cache_dtype=None,
                 compute: ComputeConfig = ComputeConfig(), **settings):
        config = dataclasses.replace(config or EngineConfig(), **settings)
        mc = model.config
        self.config, self.num_pages = config, config.num_pages
        limit = self.num_pages * config.page_size
        if not mc.rope.extends_past_max_position:
            limit = min(limit, mc.max_position_embeddings)
        self.max_seq_len = min(config.max_seq_len or limit, limit)
        self.model, self.compute, self.page_size = model, compute, config.page_size
        self.max_seqs = config.max_seqs
        pages_per_seq = ceil_div(self.max_seq_len, config.page_size)
        if cache_dtype is None:
            cache_dtype = model.dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        self._bank = has_bank(model)
        self._pages_per_seq, self._cache_dtype = pages_per_seq, cache_dtype
        with mesh_context(model):
            mesh = current_mesh()
            platform = target_platform(mesh)
            heads = mc.num_attention_heads // mesh_axis_size(mesh, RULES["heads"])
        on_cpu = platform == "cpu"
        self.share_rows = config.decode_run_rows(platform, heads)
        self._min_chunk = config.min_prefill_chunk or (16 if on_cpu else 128)
        self._min_rows = config.min_decode_rows or (1 if on_cpu else 8)
        self._mixed = config.mixed_steps and not mc.rope.depends_on_length
        if config.mixed_steps and not self._mixed:
            log_once("engine: a prefill pass, then a decode pass per step (not mixed_steps: this model's RoPE "
                     "scaling depends on the longest sequence of a call)")
        self.reset()

    def reset(self) -> None:
        """Drop every request and result and start over on a fresh page pool (after a
        step failed, its donated pool may be gone). Request ids go on from the old ones."""
        config = self.config
        first_id = self.scheduler.next_id if hasattr(self, "scheduler") else 0
        self.scheduler = Scheduler(max_seqs=config.max_seqs, num_pages=self.num_pages, page_size=config.page_size,
                                   pages_per_seq=self._pages_per_seq, prefill_chunk=config.prefill_chunk,
                                   prefill_rows=config.prefill_rows, bank=self._bank, first_id=first_id,
                                   score_top_k=config.max_top_logprobs, mixed=self._mixed,
                                   min_chunk=self._min_chunk, min_rows=self._min_rows,
                                   share_rows=self.share_rows)
        self.runner = Runner(self.model, num_pages=self.num_pages, page_size=config.page_size,
                             max_seqs=config.max_seqs, pages_per_seq=self._pages_per_seq, dtype=self._cache_dtype,
                             compute=self.compute, top_logprobs=config.max_top_logprobs)
        self._in_flight: tuple[DecodeBatch, OnDevice] | None = None  # a launched decode step not yet recorded

    def set_model(self, model: CausalLM) -> None:
        """Sample from new weights from now on (e.g. after a training step: the arrays
        are used as they are, not copied). `model` must have the engine's structure
        and shapes (same config, same adapters), and the engine must be idle: a
        running request's keys/values came from the old weights. The prefix cache is
        emptied for the same reason."""
        if self.has_work():
            raise ValueError("set_model while requests are waiting or running: their keys/values would mix weights")

        def signature(m):
            leaves, treedef = jax.tree.flatten(m)
            return treedef, [(x.shape, x.dtype) if eqx.is_array(x) else x for x in leaves]

        if signature(model) != signature(self.model):
            raise ValueError("set_model needs a model of the engine's structure and shapes (same config and adapters)")
        self.model = self.runner.model = model
        self.scheduler.pool.forget()

    def set_adapter(self, slot: int, adapter_model) -> None:
        """Sample adapter `slot` of the bank from the plain adapters of `adapter_model`
        (`set_adapter_slot`: same base, targets, rank and alpha) from now on. No waiting
        or running request may use the slot (its keys/values came from the old weights);
        the other slots' requests run on. The prefix cache is emptied."""
        if not self._bank:
            raise ValueError("set_adapter needs a model with a LoRA adapter bank")
        if self.scheduler.uses_adapter(slot):
            raise ValueError(f"set_adapter({slot}) while requests of adapter {slot} are waiting or running")
        self.model = self.runner.model = set_adapter_slot(self.model, slot, adapter_model)
        self.scheduler.pool.forget()

    # -- requests ----------------------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), *, sample: int = 0,
            adapter: int | None = None, score_last_n: int | None = None, score_top_k: int = 0) -> int:
        """Queue a request; returns its id. `sample`: which of a prompt's `n` samples it
        is (its seed stream, as `generate(..., n=n)`); samples of one prompt share its
        cached pages. `adapter`: for a model with a LoRA bank, the adapter the request
        runs with (required then). `score_last_n`: also score the prompt's last
        `score_last_n` tokens, each with its `score_top_k` most likely alternatives
        (the result's `prompt_scores`): the prefill computes them on its way, and the
        prefix before them comes from the prefix cache where it holds it. Raises
        `ValueError` for a request the engine can never hold (longer than `max_seq_len`,
        or needing more pages than the pool), a missing or unknown adapter, or tokens to
        score that the prompt does not have."""
        [prompt], [params] = check_requests(self.model.config, [prompt_ids], [params], 1, None)
        if self._bank or adapter is not None:
            check_adapter_ids(self.model, None if adapter is None else np.asarray([adapter]), 1, name="adapter")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"request needs {len(prompt)} prompt + {params.max_new_tokens} new tokens = {total}, "
                             f"more than the engine's max_seq_len {self.max_seq_len}")
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.model.config.eos_token_ids
        score = None if score_last_n is None else (score_last_n, score_top_k)
        return self.scheduler.add(prompt, params, sample=sample, adapter=adapter, stop=stop, score=score)

    def has_work(self) -> bool:
        """Whether any request is waiting or running (or has a token not yet returned by `step`)."""
        return self.scheduler.has_work()

    def result(self, request_id: int) -> Generation:
        """The finished request's result (removed from the engine). `KeyError` if it is not finished."""
        return self.scheduler.finished.pop(request_id)

    def cancel(self, request_id: int) -> None:
        """Stop a waiting or running request now (a client went away): its slot and
        pages are freed and no result is kept. Unknown or finished ids are ignored."""
        self.scheduler.cancel(request_id)

    def run(self, requests: Iterable[tuple[Sequence[int], SamplingParams]], *, n: int = 1,
            adapters: Sequence[int] | None = None) -> list[Generation]:
        """Add `n` samples of every `(prompt_ids, params)` (with `adapters[i]` for a LoRA
        bank) and step until all finish. Returns the results prompt-major (the `n`
        samples of request 0 first), as `generate(..., n=n)`."""
        requests = list(requests)
        each: list[int | None] = [None] * len(requests) if adapters is None else list(adapters)
        if len(each) != len(requests):
            raise ValueError(f"{len(each)} adapters for {len(requests)} requests")
        ids = [self.add(prompt, params, sample=j, adapter=a)
               for (prompt, params), a in zip(requests, each) for j in range(n)]
        while not all(i in self.scheduler.finished for i in ids):
            self.step()
        return [self.result(i) for i in ids]

    def warmup(self, progress: Callable[[int, int], object] | None = None, *, scoring: bool = False) -> None:
        """Compile every shape `step` can run (each prefill chunk size and row count,
        each padded count of running slots: `Scheduler.step_shapes`) now, on inputs
        whose writes are dropped, so that no request waits for a compile.
        `scoring`: also each prefill shape that scores prompt tokens (`add(...,
        score_last_n=...)`), with no alternatives and with up to `max_top_logprobs`.
        `progress(done, total)` is called after each shape."""
        self.runner.warmup(*self.scheduler.step_shapes(), bank=self._bank, progress=progress,
                           score_top_ks=self.scheduler.score_top_ks() if scoring else (), mixed=self.scheduler.mixed,
                           share_rows=self.scheduler.share_rows)

    @property
    def pages_in_use(self) -> int:
        """Pages in running requests' page tables."""
        return self.scheduler.pool.referenced

    def stats(self) -> dict:
        """`Scheduler.stats`: pages referenced and cached, the prefix cache's hit rate,
        preemptions, prefill chunks planned, the tokens held (a shared page's once) and
        read by a decode step (once per request), requests waiting and running."""
        return self.scheduler.stats()

    def step(self) -> list[TokenEvent]:
        """Plan (admit, one prefill chunk, one decode step) and launch it; record the
        tokens of the step launched before it (`overlap_steps`) or of this one.

        **Returns:** the recorded tokens, one event per request that is still running
        or ended with its token."""
        launched = self._launch(self.scheduler.schedule())
        if self.config.overlap_steps:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if done is None:
            return []
        batch, sampled = done
        return self.scheduler.finish_step(batch, *self.runner.fetch(sampled))

    def _launch(self, plan: StepPlan) -> tuple[DecodeBatch, OnDevice] | None:
        """Run `plan`'s prefill chunk (its scores recorded) and launch its decode rows
        (returned with their outputs, on the device)."""
        if plan.mixed:
            assert plan.prefill is not None and plan.decode is not None
            scores, sampled = self.runner.mixed(plan.prefill, plan.decode)
            self.scheduler.finish_prefill(plan.prefill, scores)
            return plan.decode, sampled
        if plan.prefill is not None:
            self.scheduler.finish_prefill(plan.prefill, self.runner.prefill(plan.prefill))
        return None if plan.decode is None else (plan.decode, self.runner.decode(plan.decode))
