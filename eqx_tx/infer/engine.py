"""A sampling engine: a paged KV cache and continuous batching.

`generate` runs a static batch: every request gets a cache row of the longest
`prompt + max_new_tokens`, and nothing new starts until the slowest one ends.
`Engine` keeps `max_seqs` decode slots over one pool of KV pages
(`eqx_tx.cache.paged`). Each `step()`:

1. admits waiting requests (oldest first) into free slots while the pool has
   pages for their prompts (and the first new token); requests get more pages as
   they grow, and when none is left the newest request is preempted: its pages are
   freed (its full ones stay cached) and it waits at the front of the queue, to be
   prefilled again with the tokens it already has (mostly from the prefix cache) and
   go on where it stopped, so a full pool makes requests wait, never fail;
2. prefills one chunk (`prefill_chunk` positions) of each of the `prefill_rows`
   oldest admitted requests,
   starting after the longest prefix whose pages are cached from earlier requests
   (`eqx_tx.infer.page_pool`: full pages keyed by their token prefix, shared by
   reference count, least recently used evicted first);
3. runs one decode step for every running request (one jitted call, fixed shapes:
   nothing recompiles as requests come and go), handing out pages as they fill.

A finished request's slot and pages go to the next waiting request at once (its
full pages stay cached until the space is needed). With a LoRA adapter bank
(`apply_lora(..., adapters=n)`) each request names its adapter, rows of one batch
use different adapters, and cached pages are shared only between requests of the
same adapter. Each request's tokens and log-probs equal `generate` on that
request alone: the sampler draws token `i` with the request's own key
(`SamplingParams.seed`), and attention reads exactly the request's own positions.
"""

import collections
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..core.compute import ComputeConfig
from ..core.distributed import to_host
from .generation import STOP_REASONS, Generation, _check_requests, _decode_one, _last_token_logits
from ..layers.attention import AttentionMask
from ..layers.lora import check_adapter_ids, has_bank, select_adapters
from ..cache.paged import PagedKVCache
from ..models import CausalLM
from ..models.transformer import new_paged_cache
from .page_pool import PagePool
from .sampling import SamplerArrays, SamplingParams, sample_batch
from ..core.sharding import constrain, current_mesh, mesh_context
from ..core.util import ceil_div


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One new token of a request; `finish_reason` is `"stop"` or `"length"` on its last."""

    request_id: int
    token: int
    logprob: float
    finish_reason: str | None = None


@dataclasses.dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    sample: int
    adapter: int | None
    stop: frozenset[int]
    pages_needed: int
    promised: int = 0  # pages promised and not yet taken
    slot: int | None = None
    admitted: int = 0  # admission order (the newest is preempted first)
    context: list[int] = dataclasses.field(default_factory=list)  # prefilled on admission: prompt + tokens so far
    pages: list[int] = dataclasses.field(default_factory=list)
    looked_up: bool = False  # the prefix cache was asked
    prefilled: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.slot is not None and self.prefilled == len(self.context)

    @property
    def namespace(self) -> int:
        """Its prefix-cache namespace: keys/values are shared only within one adapter."""
        return self.adapter or 0

    @property
    def written(self) -> list[int]:
        """The tokens whose keys/values are in its pages (every sampled token is fed)."""
        return self.prompt + self.tokens if self.running else self.context[: self.prefilled]


@functools.partial(jax.jit, static_argnames="compute", donate_argnames=("cache", "logits"))
def _prefill_chunk(model: CausalLM, cache: PagedKVCache, logits, rows, table, tokens, start, length, adapters, *,
                   compute: ComputeConfig):
    """Positions `[start[i], start[i] + C)` of `P` contexts (`tokens [P, C]`, real up to
    `length[i]`) into their pages (`table [P, pages_per_seq]`; padding rows: unallocated).
    Each context's next-token logits go to slot `rows[i]` (out of range: dropped, for
    padding and contexts that do not end in this chunk). `adapters [P]`: each context's
    adapter of the model's LoRA bank (`None` without one)."""
    if adapters is not None:
        model = select_adapters(model, adapters)
    C = tokens.shape[1]
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    mask = AttentionMask(kv_lengths=length, q_offset=start)
    out = model.hidden_states(tokens, positions=positions, mask=mask, compute=compute, cache=cache.with_table(table))
    assert isinstance(out.cache, PagedKVCache)
    last = jnp.take_along_axis(out.hidden, jnp.clip(length - 1 - start, 0, C - 1)[:, None, None], axis=1)[:, 0]
    logits = logits.at[rows].set(_last_token_logits(model, last), mode="drop")
    return out.cache.with_table(cache.page_table), logits


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zero_logits(rows: int, vocab: int):
    return constrain(jnp.zeros((rows, vocab), jnp.float32), (None, "act_vocab"))


@functools.partial(jax.jit, static_argnames="compute", donate_argnames=("cache", "logits"))
def _decode_step(model: CausalLM, cache: PagedKVCache, logits, rows, table, positions, generated, adapters,
                 sampler: SamplerArrays, *, compute: ComputeConfig):
    """For the slots `rows [R]` (padding: an out-of-range slot): sample token
    `generated[i]` from the slot's logits, feed it at `positions[i]` through the
    slot's pages `table [R, pages_per_seq]` (padding rows: unallocated, their writes
    dropped) with adapter `adapters[i]` (`None`: no bank) and store the next logits.
    Returns the tokens and their log-probs."""
    if adapters is not None:
        model = select_adapters(model, adapters)
    token, logp = sample_batch(jnp.take(logits, rows, axis=0, mode="clip"), sampler, generated)
    out, new = _decode_one(model, cache.with_table(table), token, positions, AttentionMask.decode(positions), compute)
    assert isinstance(out, PagedKVCache)
    return out.with_table(cache.page_table), logits.at[rows].set(new, mode="drop"), token, logp


class Engine:
    """Continuous batching over a paged KV cache.

    **Arguments:**

    - `model`: the model (possibly sharded over `tp`: the pool's kv heads follow it).
    - `max_seqs`: decode slots (sequences generating at once).
    - `max_tokens_in_cache`: the pool's size in tokens (rounded down to whole pages).
    - `page_size`: tokens per page.
    - `prefill_chunk`, `prefill_rows`: each step prefills one chunk of up to
      `prefill_chunk` positions of each of the `prefill_rows` oldest admitted requests
      (shorter remainders run in the smallest power-of-two chunk, at least 16, that
      holds them).
    - `max_seq_len`: the longest `prompt + max_new_tokens` a request may have
      (default: the pool, or the model's position limit if smaller).
    - `cache_dtype`: the pool's dtype (default: the model's); `"int8"` as `generate`.
    - `compute`: attention implementation etc.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        max_seqs: int,
        max_tokens_in_cache: int,
        page_size: int = 16,
        prefill_chunk: int = 256,
        prefill_rows: int = 4,
        max_seq_len: int | None = None,
        cache_dtype=None,
        compute: ComputeConfig = ComputeConfig(),
    ):
        config = model.config
        for name, value in (("max_seqs", max_seqs), ("page_size", page_size), ("prefill_chunk", prefill_chunk),
                            ("prefill_rows", prefill_rows)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if prefill_rows & (prefill_rows - 1):
            raise ValueError(f"prefill_rows must be a power of two, got {prefill_rows}")
        self.num_pages = max_tokens_in_cache // page_size
        if self.num_pages < 1:
            raise ValueError(f"max_tokens_in_cache {max_tokens_in_cache} holds no page of {page_size} tokens")
        limit = self.num_pages * page_size
        if not config.rope.extends_past_max_position:
            limit = min(limit, config.max_position_embeddings)
        self.max_seq_len = min(max_seq_len or limit, limit)
        self.model, self.compute, self.page_size, self.prefill_chunk = model, compute, page_size, prefill_chunk
        self.max_seqs, self.prefill_rows = max_seqs, prefill_rows
        pages_per_seq = ceil_div(self.max_seq_len, page_size)
        dtype = model.dtype if cache_dtype is None else cache_dtype
        with mesh_context(model):
            self._cache = new_paged_cache(config, pages=self.num_pages, page_size=page_size, batch=max_seqs,
                                          pages_per_seq=pages_per_seq, dtype=dtype, mesh=current_mesh())
            self._logits = _zero_logits(max_seqs, config.vocab_size)
        self._table = np.full((max_seqs, pages_per_seq), self.num_pages, np.int32)
        self._pool = PagePool(self.num_pages, page_size)
        self._prompt_tokens = self._cached_tokens = self._preemptions = self._admissions = 0
        self._slots: list[_Request | None] = [None] * max_seqs
        self._waiting: collections.deque[_Request] = collections.deque()
        self._finished: dict[int, Generation] = {}
        self._next_id = 0
        self._sampler: tuple[tuple, SamplerArrays] | None = None  # (running ids, rows) -> their sampler
        self._bank = has_bank(model)

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
        self.model = model
        self._pool.forget()

    # -- requests ----------------------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), *, sample: int = 0,
            adapter: int | None = None) -> int:
        """Queue a request; returns its id. `sample`: which of a prompt's `n` samples it
        is (its seed stream, as `generate(..., n=n)`); samples of one prompt share its
        cached pages. `adapter`: for a model with a LoRA bank, the adapter the request
        runs with (required then). Raises `ValueError` for a request the engine can
        never hold (longer than `max_seq_len`, or needing more pages than the pool) or
        a missing or unknown adapter."""
        [prompt], [params] = _check_requests(self.model.config, [prompt_ids], [params], 1, None)
        if self._bank or adapter is not None:
            check_adapter_ids(self.model, None if adapter is None else np.asarray([adapter]), 1, name="adapter")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"request needs {len(prompt)} prompt + {params.max_new_tokens} new tokens = {total}, "
                             f"more than the engine's max_seq_len {self.max_seq_len}")
        need = ceil_div(total, self.page_size)
        if need > self.num_pages:
            raise ValueError(f"request needs {need} pages of {self.page_size} tokens; the pool has {self.num_pages}")
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.model.config.eos_token_ids
        request = _Request(self._next_id, prompt, params, sample, adapter, frozenset(stop), need)
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting) or any(r is not None for r in self._slots)

    def result(self, request_id: int) -> Generation:
        """The finished request's result (removed from the engine). `KeyError` if it is not finished."""
        return self._finished.pop(request_id)

    def cancel(self, request_id: int) -> None:
        """Stop a waiting or running request now (a client went away): its slot and
        pages are freed and no result is kept. Unknown or finished ids are ignored."""
        self._finished.pop(request_id, None)
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                return
        for request in self._slots:
            if request is not None and request.id == request_id:
                self._finish(request, None)
                return

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
        while not all(i in self._finished for i in ids):
            self.step()
        return [self.result(i) for i in ids]

    def warmup(self) -> None:
        """Compile every shape `step` can run (each prefill chunk size, each padded
        count of running slots) now, on inputs whose writes are dropped, so that no
        request waits for a compile."""
        sizes = {min(self.prefill_chunk, 16 << i) for i in range(max(self.prefill_chunk, 16).bit_length())}
        rows = {min(self.max_seqs, 1 << i) for i in range(self.max_seqs.bit_length() + 1)}
        prefill_rows = {1 << i for i in range(self.prefill_rows.bit_length())}
        unallocated = np.full((1, self._table.shape[1]), self.num_pages, np.int32)
        with mesh_context(self.model):
            for C, P in itertools.product(sorted(sizes), sorted(prefill_rows)):
                self._cache, self._logits = _prefill_chunk(
                    self.model, self._cache, self._logits, jnp.full((P,), self.max_seqs, jnp.int32),
                    jnp.asarray(np.repeat(unallocated, P, axis=0)), jnp.zeros((P, C), jnp.int32),
                    jnp.zeros((P,), jnp.int32), jnp.ones((P,), jnp.int32), self._adapter_ids([], P),
                    compute=self.compute,
                )
            for R in sorted(rows):
                idle = jnp.full((R,), self.max_seqs, jnp.int32)  # out of range: nothing stored
                self._cache, self._logits, _, _ = _decode_step(
                    self.model, self._cache, self._logits, idle, jnp.asarray(np.repeat(unallocated, R, axis=0)),
                    jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.int32), self._adapter_ids([], R),
                    self._sampler_arrays([], R),
                    compute=self.compute,
                )

    @property
    def pages_in_use(self) -> int:
        """Pages in running requests' page tables."""
        return self._pool.referenced

    def stats(self) -> dict:
        """Pages referenced and cached, the prefix cache's hit rate (the share of
        admitted prompt tokens whose keys/values came from the cache), preemptions, and
        the tokens the running requests hold in their pages (shared ones once each)."""
        return dict(pages=self.num_pages, pages_in_use=self._pool.referenced, pages_cached=self._pool.cached,
                    prompt_tokens=self._prompt_tokens, cached_tokens=self._cached_tokens,
                    hit_rate=self._cached_tokens / max(self._prompt_tokens, 1), preemptions=self._preemptions,
                    tokens_held=sum(len(r.written) for r in self._slots if r is not None))

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Admit, prefill one chunk, decode one token for every running request.

        **Returns:** the new tokens, one event per running request."""
        self._admit()
        with mesh_context(self.model):
            self._prefill()
            return self._decode()

    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            request = self._waiting[0]
            context = request.prompt + request.tokens  # tokens: those of a preempted request
            pages = min(request.pages_needed, ceil_div(len(context) + 1, self.page_size))
            if not self._pool.promise(pages):
                return  # the oldest waits for pages (no overtaking: no starvation)
            self._waiting.popleft()
            request.context, request.promised, request.admitted = context, pages, self._admissions
            self._admissions += 1
            request.slot = self._slots.index(None)
            self._slots[request.slot] = request

    def _page_for(self, request: _Request) -> bool:
        """One more page for `request`, preempting the newest requests while none is left.
        Returns `False` if `request` itself was preempted."""
        while request.promised == 0 and not self._pool.promise(1):
            victim = max((r for r in self._slots if r is not None), key=lambda r: r.admitted)
            self._release(victim)
            victim.pages, victim.promised, victim.prefilled, victim.looked_up = [], 0, 0, False
            self._waiting.appendleft(victim)
            self._preemptions += 1
            if victim is request:
                return False
        request.promised = max(request.promised, 1)
        self._take_page(request)
        return True

    def _take_page(self, request: _Request) -> None:
        assert request.slot is not None and request.promised > 0
        page = self._pool.take()
        self._table[request.slot, len(request.pages)] = page
        request.pages.append(page)
        request.promised -= 1

    def _reuse_prefix(self, request: _Request) -> None:
        """Start `request` after its longest cached prefix (its last prompt token is
        always computed: its logits are needed)."""
        assert request.slot is not None
        shared = self._pool.share(request.context, (len(request.context) - 1) // self.page_size,
                                  namespace=request.namespace)
        request.looked_up, request.pages, request.promised = True, shared, request.promised - len(shared)
        self._table[request.slot, : len(shared)] = shared
        request.prefilled = len(shared) * self.page_size
        self._prompt_tokens += len(request.context)
        self._cached_tokens += request.prefilled

    def _sharing_in_flight(self, request: _Request, others: list[_Request]) -> bool:
        """Whether one of `others` (being prefilled) is computing full pages of
        `request`'s prefix that the cache does not hold yet: then `request` waits for
        them and shares them instead of computing them again."""
        ps, limit = self.page_size, (len(request.context) - 1) // self.page_size
        cached = self._pool.cached_pages(request.context, limit, namespace=request.namespace)
        for other in others:
            if other.namespace != request.namespace:
                continue
            common = 0
            while (common < limit and (common + 1) * ps <= len(other.context)
                   and other.context[common * ps : (common + 1) * ps] == request.context[common * ps : (common + 1) * ps]):
                common += 1
            if common > cached:
                return True
        return False

    def _prefill(self) -> None:
        pending = []
        for r in sorted((r for r in self._slots if r is not None and not r.running), key=lambda r: r.admitted):
            if len(pending) == self.prefill_rows:
                break
            if r.looked_up or not self._sharing_in_flight(r, pending):
                pending.append(r)
        if not pending:
            return
        for request in pending:
            if not request.looked_up:
                self._reuse_prefix(request)
        # One chunk for each of the oldest admitted requests: the smallest power of two (>= 16)
        # holding the longest remainder, up to prefill_chunk (a prompt after a cached prefix
        # costs a short chunk); rows padded to a power of two. Few shapes compile.
        longest = max(len(r.context) - r.prefilled for r in pending)
        C = min(self.prefill_chunk, max(16, 1 << (longest - 1).bit_length()))
        P = 1 << (len(pending) - 1).bit_length()
        rows = np.full((P,), self.max_seqs, np.int32)
        table = np.full((P, self._table.shape[1]), self.num_pages, np.int32)
        tokens = np.zeros((P, C), np.int32)
        start, length = np.zeros((P,), np.int32), np.ones((P,), np.int32)
        for i, r in enumerate(pending):
            assert r.slot is not None
            end = min(r.prefilled + C, len(r.context))
            while len(r.pages) * self.page_size < end:
                self._take_page(r)  # (promised on admission)
            tokens[i, : end - r.prefilled] = r.context[r.prefilled : end]
            table[i], start[i], length[i] = self._table[r.slot], r.prefilled, len(r.context)
            rows[i] = r.slot if end == len(r.context) else self.max_seqs
            r.prefilled = end
        self._cache, self._logits = _prefill_chunk(
            self.model, self._cache, self._logits, jnp.asarray(rows), jnp.asarray(table), jnp.asarray(tokens),
            jnp.asarray(start), jnp.asarray(length), self._adapter_ids(pending, P), compute=self.compute,
        )
        for r in pending:
            if r.running:
                self._pool.register(r.context, r.pages, namespace=r.namespace)  # later requests may share them

    def _adapter_ids(self, requests: list[_Request], rows: int):
        """Each row's adapter (padding rows: adapter 0), or `None` for a model without a bank."""
        if not self._bank:
            return None
        return jnp.asarray([r.adapter for r in requests] + [0] * (rows - len(requests)), jnp.int32)

    def _sampler_arrays(self, running: list[_Request], rows: int) -> SamplerArrays:
        key = (tuple(r.id for r in running), rows)
        if self._sampler is None or self._sampler[0] != key:
            params = [r.params for r in running] + [SamplingParams()] * (rows - len(running))
            samples = [r.sample for r in running] + [0] * (rows - len(running))
            # Stops are checked here, on the host: no stop ids on the device (one shape for all).
            params = [dataclasses.replace(p, stop_token_ids=()) for p in params]
            self._sampler = key, SamplerArrays.from_params(params, (), self.model.config.vocab_size, samples)
        return self._sampler[1]

    def _decode(self) -> list[TokenEvent]:
        running = sorted((r for r in self._slots if r is not None and r.running), key=lambda r: r.admitted)
        for r in running:  # a page for this step's token where the last one is full (oldest first)
            if r.slot is not None and (len(r.prompt) + len(r.tokens)) // self.page_size >= len(r.pages):
                self._page_for(r)
        running = [r for r in running if r.slot is not None]
        if not running:
            return []
        # The running slots, padded to a power of two: a few compiled shapes, no work for idle slots.
        R = min(self.max_seqs, 1 << (len(running) - 1).bit_length())
        rows = np.full((R,), self.max_seqs, np.int32)
        table = np.full((R, self._table.shape[1]), self.num_pages, np.int32)
        positions = np.zeros((R,), np.int32)
        generated = np.zeros((R,), np.int32)
        for i, r in enumerate(running):
            assert r.slot is not None
            position = len(r.prompt) + len(r.tokens)  # where this step's token is written
            rows[i], table[i], positions[i], generated[i] = r.slot, self._table[r.slot], position, len(r.tokens)
        self._cache, self._logits, token, logp = _decode_step(
            self.model, self._cache, self._logits, jnp.asarray(rows), jnp.asarray(table), jnp.asarray(positions),
            jnp.asarray(generated), self._adapter_ids(running, R), self._sampler_arrays(running, R),
            compute=self.compute,
        )
        token, logp = to_host(token), to_host(logp)
        events = []
        for i, r in enumerate(running):
            t, lp = int(token[i]), float(logp[i])
            r.tokens.append(t)
            r.logprobs.append(lp)
            reason = "stop" if t in r.stop else "length" if len(r.tokens) >= r.params.max_new_tokens else None
            events.append(TokenEvent(r.id, t, lp, reason))
            if reason is not None:
                self._finish(r, reason)
        return events

    def _release(self, request: _Request) -> None:
        """Free the request's slot and pages (its full pages stay cached by their tokens)."""
        assert request.slot is not None
        self._pool.register(request.written, request.pages, namespace=request.namespace)
        self._pool.release(request.pages)
        self._pool.unpromise(request.promised)
        self._table[request.slot] = self.num_pages
        self._slots[request.slot] = None
        request.slot = None

    def _finish(self, request: _Request, reason: str | None) -> None:
        """Free the request; keep its result unless it was cancelled (`reason` None)."""
        self._release(request)
        if reason is not None:
            assert reason in STOP_REASONS
            self._finished[request.id] = Generation(request.tokens, request.logprobs, reason)
