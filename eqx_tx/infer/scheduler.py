"""The engine's host side: which requests run, which pages they hold, what each step does.

`Scheduler` knows requests, slots and pages, never a model or an array on a device,
so it is tested on its own. Each `schedule()`:

1. admits waiting requests (oldest first) into free slots while the pool has
   pages for their prompts (and the first new token); requests get more pages as
   they grow, and when none is left the newest request is preempted: its pages are
   freed (its full ones stay cached) and it waits at the front of the queue, to be
   prefilled again with the tokens it already has (mostly from the prefix cache) and
   go on where it stopped, so a full pool makes requests wait, never fail;
2. plans one prefill chunk (`prefill_chunk` positions) of each of the `prefill_rows`
   oldest admitted requests, starting after the longest prefix whose pages are
   cached from earlier requests (`eqx_tx.infer.page_pool`) and that ends before the
   prompt tokens the request asked to have scored (`score`: their log-probs come
   out of the prefill chunks that compute them);
3. plans one decode step for every running request, handing out pages as they fill.

With `mixed` (`EngineConfig.mixed_steps`), the decode step is planned first, for the
requests running before this step, and a step with a prefill chunk runs both in one
pass through the model (`eqx_tx.infer.steps.paged_mixed_step`): its decode rows are
padded to `max_seqs` (one compiled shape per prefill shape), and a context whose
prefill ends in it samples its first token the step after. Without, the prefill runs
first and a context it completes decodes in the same step.

It returns a `StepPlan` of padded numpy arrays (a few power-of-two shapes, so little
compiles) that a runner executes (`eqx_tx.infer.runner`); `finish_step` then takes
the sampled tokens and returns one `TokenEvent` per running request.
"""

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from ..core.util import ceil_div
from .page_pool import PagePool
from .sampling import SamplingParams
from .steps import STOP_REASONS, Generation, PromptScores


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One new token of a request; `finish_reason` is `"stop"` or `"length"` on its last."""

    request_id: int
    token: int
    logprob: float
    finish_reason: str | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their log-probs, if asked
    prompt_scores: PromptScores | None = None  # on a request's first token, if it asked for them


@dataclasses.dataclass(eq=False)
class Request:
    """A request's host-side state."""

    id: int
    prompt: list[int]
    params: SamplingParams
    sample: int  # which of its prompt's n samples (its seed stream)
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
    score: tuple[int, int] | None = None  # (last n prompt tokens, top k) to score
    scores: dict[int, tuple] = dataclasses.field(default_factory=dict)  # position -> (logp, top ids, top logps)
    pending: int = 0  # tokens of planned decode steps not yet recorded (`finish_step`)
    ended: bool = False  # finished or cancelled: rows of it in steps still running are dropped

    @property
    def decoded(self) -> int:
        """Tokens sampled for it: recorded, and planned in steps not yet finished."""
        return len(self.tokens) + self.pending

    @property
    def scores_missing(self) -> bool:
        return self.score is not None and len(self.scores) < self.score[0]

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


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """One chunk of `C` positions of `P` contexts (padding rows: unallocated pages,
    out-of-range `rows`)."""

    rows: np.ndarray  # [P] the slot whose next-token logits a context's last chunk sets
    table: np.ndarray  # [P, pages_per_seq]
    tokens: np.ndarray  # [P, C]
    start: np.ndarray  # [P] the chunk's first position
    length: np.ndarray  # [P] the context's length
    adapters: np.ndarray | None  # [P] each context's adapter of a bank
    requests: tuple[Request, ...] = ()  # the contexts of the first rows
    targets: np.ndarray | None = None  # [P, C] the token each position is scored on (-1: not scored); None: none is
    top_k: int = 0  # alternatives scored per position


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step of the running requests, padded to `R` rows."""

    requests: tuple[Request, ...]
    rows: np.ndarray  # [R] slots
    table: np.ndarray  # [R, pages_per_seq]
    positions: np.ndarray  # [R] where each row's new token is written
    generated: np.ndarray  # [R] tokens generated so far (the sampler's step)
    adapters: np.ndarray | None  # [R]
    request_rows: np.ndarray | None = None  # the row of each request (None: request i in row i)
    share_rows: int = 0  # > 1: laid out in runs of this many rows that share leading pages (`_runs`)

    def row_of(self) -> np.ndarray:
        """The row of each of `requests`."""
        return np.arange(len(self.requests)) if self.request_rows is None else self.request_rows

    @property
    def sampler_key(self) -> tuple:
        return tuple(r.id for r in self.requests), tuple(self.row_of().tolist()), len(self.rows)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one engine step runs: a prefill chunk, then a decode step (either may be
    absent), or with `mixed` both in one pass (then both are present)."""

    prefill: PrefillBatch | None
    decode: DecodeBatch | None
    mixed: bool = False


class Scheduler:
    """Requests, slots and the page pool of an engine (no model, no device arrays).

    **Arguments:** `max_seqs` slots; a pool of `num_pages` pages of `page_size`
    tokens; requests of up to `pages_per_seq` pages; `prefill_chunk` and
    `prefill_rows` as in `EngineConfig`; `bank`: requests name an adapter of a LoRA
    bank (padding rows get adapter 0); `first_id`: the first request's id (a scheduler
    that replaces another goes on from its ids: a late cancel never hits a new request);
    `mixed`: plan a step's prefill chunk and decode rows to run in one pass (module docstring);
    `min_chunk`, `min_rows`: the smallest chunk a prefill remainder and the fewest rows a
    decode step are padded to (`EngineConfig.min_prefill_chunk`, `min_decode_rows`);
    `share_rows`: lay decode steps out in runs of this many rows of requests that share
    their first page (`EngineConfig.shared_decode_rows`; 0: off).
    """

    def __init__(self, *, max_seqs: int, num_pages: int, page_size: int, pages_per_seq: int, prefill_chunk: int,
                 prefill_rows: int, bank: bool = False, first_id: int = 0, score_top_k: int = 0, mixed: bool = False,
                 min_chunk: int = 16, min_rows: int = 1, share_rows: int = 0):
        self.max_seqs, self.num_pages, self.page_size, self.mixed = max_seqs, num_pages, page_size, mixed
        self.min_chunk, self.min_rows, self.share_rows = min_chunk, min_rows, share_rows
        self.score_top_k = score_top_k
        self.prefill_chunk, self.prefill_rows, self.bank = prefill_chunk, prefill_rows, bank
        self.table = np.full((max_seqs, pages_per_seq), num_pages, np.int32)
        self.pool = PagePool(num_pages, page_size)
        self.prompt_tokens = self.cached_tokens = self.preemptions = self._admissions = 0
        self.prefill_chunks = 0  # prefill chunks planned (each one pass, alone or beside the decode rows)
        self.slots: list[Request | None] = [None] * max_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.finished: dict[int, Generation] = {}
        self.next_id = first_id

    # -- requests ----------------------------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams, *, sample: int, adapter: int | None,
            stop: Sequence[int], score: tuple[int, int] | None = None) -> int:
        """Queue a checked request; returns its id. `score = (n, k)`: also score its
        last `n` prompt tokens, with `k` alternatives each (its result's
        `prompt_scores`). Raises `ValueError` if the pool can never hold it or `n` is
        not in `[1, len(prompt) - 1]`."""
        need = ceil_div(len(prompt) + params.max_new_tokens, self.page_size)
        if need > self.num_pages:
            raise ValueError(f"request needs {need} pages of {self.page_size} tokens; the pool has {self.num_pages}")
        if score is not None and not (1 <= score[0] <= len(prompt) - 1 and score[1] >= 0):
            raise ValueError(f"can score 1 to {len(prompt) - 1} tokens of a {len(prompt)}-token prompt (with k >= 0 "
                             f"alternatives), asked for {score[0]} (k={score[1]})")
        request = Request(self.next_id, prompt, params, sample, adapter, frozenset(stop), need, score=score)
        self.next_id += 1
        self.waiting.append(request)
        return request.id

    def has_work(self) -> bool:
        """Whether any request is waiting or running (a request whose last token is
        planned but not yet recorded is still running)."""
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def uses_adapter(self, adapter: int) -> bool:
        """Whether a waiting or running request runs with `adapter` (of a bank)."""
        return any(r is not None and r.adapter == adapter for r in (*self.waiting, *self.slots))

    def cancel(self, request_id: int) -> None:
        """Drop a waiting or running request (its slot and pages freed; its rows in
        planned steps not yet finished are dropped) or a kept result."""
        self.finished.pop(request_id, None)
        for request in (*self.waiting, *self.slots):
            if request is not None and request.id == request_id:
                self._finish(request, None)
                return

    def stats(self) -> dict:
        """Pages referenced and cached, the prefix cache's hit rate (the share of
        admitted prompt tokens whose keys/values came from the cache), preemptions, the
        prefill chunks planned (each one pass, alone or beside the decode rows), the
        tokens whose keys/values the requests in slots hold (`tokens_held`: a shared
        page's once) and read (`tokens_read`: a shared page's once per request, as a
        decode step reads them), and the requests waiting for a slot and holding one."""
        held: dict[int, int] = {}  # page -> its tokens in use
        read = 0
        for r in self.slots:
            if r is None:
                continue
            n = len(r.written)
            read += n
            for i, page in enumerate(r.pages[:ceil_div(n, self.page_size)]):
                held[page] = max(held.get(page, 0), min(self.page_size, n - i * self.page_size))
        return dict(pages=self.num_pages, pages_in_use=self.pool.referenced, pages_cached=self.pool.cached,
                    prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                    hit_rate=self.cached_tokens / max(self.prompt_tokens, 1), preemptions=self.preemptions,
                    prefill_chunks=self.prefill_chunks,
                    tokens_held=sum(held.values()), tokens_read=read,
                    waiting=len(self.waiting), running=sum(r is not None for r in self.slots))

    def scored_alternatives(self, k: int) -> int:
        """The alternatives a prefill batch scores when its requests ask for at most `k`
        (each keeps its own first ones): none for 0, else `score_top_k` where it is
        enough, else the power of two at or above `k`. Few values, so few shapes to
        compile (`score_top_ks`)."""
        if k == 0:
            return 0
        return self.score_top_k if k <= self.score_top_k else 1 << (k - 1).bit_length()

    def score_top_ks(self) -> list[int]:
        """The alternatives a scoring prefill batch computes for requests that ask for
        at most `score_top_k` (for compiling ahead: `Engine.warmup(scoring=True)`)."""
        return sorted({0, self.scored_alternatives(self.score_top_k)})

    def step_shapes(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Every `(chunk, rows)` a prefill batch and every row count a decode batch can
        have (for compiling them ahead: `Engine.warmup`; with `mixed`, a prefill batch
        runs beside `max_seqs` decode rows)."""
        sizes = {min(self.prefill_chunk, self.min_chunk << i) for i in range(self.prefill_chunk.bit_length())}
        prefill_rows = {1 << i for i in range(self.prefill_rows.bit_length())}
        rows = {self._bucket(1 << i) for i in range(self.max_seqs.bit_length() + 1)}
        return [(C, P) for C in sorted(sizes) for P in sorted(prefill_rows)], sorted(rows)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Admit, plan one prefill chunk and one decode step (module docstring)."""
        self._admit()
        if not self.mixed:
            prefill = self._plan_prefill()
            return StepPlan(prefill, self._decode_batch(self._decoding()))
        running = self._decoding()  # the requests running before this step (their logits exist)
        prefill = self._plan_prefill()
        if prefill is None:
            return StepPlan(None, self._decode_batch(running))
        return StepPlan(prefill, self._decode_batch(running, self.max_seqs), mixed=True)

    def finish_prefill(self, batch: PrefillBatch, scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> None:
        """Record the scores a prefill chunk computed (`[P, C]`, `[P, C, k]` twice; see
        `PrefillBatch.targets`) on the requests that asked for them."""
        if batch.targets is None or scores is None:
            return
        logp, top_ids, top_logp = scores
        for i, r in enumerate(batch.requests):
            if r.score is None:
                continue
            k = r.score[1]
            for c in np.flatnonzero(batch.targets[i] >= 0):
                r.scores[int(batch.start[i]) + int(c)] = (float(logp[i, c]), top_ids[i, c, :k], top_logp[i, c, :k])

    def finish_step(self, batch: DecodeBatch, tokens: np.ndarray, logprobs: np.ndarray,
                    top: tuple[np.ndarray, np.ndarray] | None = None) -> list[TokenEvent]:
        """Record each running request's new token (row `i` of `tokens`, `logprobs`, and
        of the alternatives `top = (ids, logprobs)` if given); finished requests free
        their slot and pages. Returns one event per request.

        Steps are finished in the order they were planned, and a step may be planned
        before the one before it is finished (`Engine`'s overlapped steps): it then
        decodes every request that has not reached its length, and a request whose
        earlier token turns out to stop it has its row dropped here (no event)."""
        events = []
        for i, r in zip(batch.row_of(), batch.requests):
            if r.ended:
                continue
            r.pending -= 1
            t, lp = int(tokens[i]), float(logprobs[i])
            r.tokens.append(t)
            r.logprobs.append(lp)
            reason = "stop" if t in r.stop else "length" if len(r.tokens) >= r.params.max_new_tokens else None
            alternatives = () if top is None else tuple(zip(map(int, top[0][i]), map(float, top[1][i])))
            scores = _prompt_scores(r) if len(r.tokens) == 1 else None
            events.append(TokenEvent(r.id, t, lp, reason, alternatives, scores))
            if reason is not None:
                self._finish(r, reason)
        return events

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            request = self.waiting[0]
            # (preempted while planning step t + 1, its token of step t is recorded before step t + 2 is planned)
            assert not request.pending, "a request is admitted before its last token is recorded"
            context = request.prompt + request.tokens  # tokens: those of a preempted request
            pages = min(request.pages_needed, ceil_div(len(context) + 1, self.page_size))
            if not self.pool.promise(pages):
                return  # the oldest waits for pages (no overtaking: no starvation)
            self.waiting.popleft()
            request.context, request.promised, request.admitted = context, pages, self._admissions
            self._admissions += 1
            request.slot = self.slots.index(None)
            self.slots[request.slot] = request

    def _page_for(self, request: Request) -> bool:
        """One more page for `request`, preempting the newest requests while none is left.
        Returns `False` if `request` itself was preempted."""
        while request.promised == 0 and not self.pool.promise(1):
            victim = max((r for r in self.slots if r is not None), key=lambda r: r.admitted)
            self._release(victim)
            victim.pages, victim.promised, victim.prefilled, victim.looked_up = [], 0, 0, False
            self.waiting.appendleft(victim)
            self.preemptions += 1
            if victim is request:
                return False
        request.promised = max(request.promised, 1)
        self._take_page(request)
        return True

    def _take_page(self, request: Request) -> None:
        assert request.slot is not None and request.promised > 0
        page = self.pool.take()
        self.table[request.slot, len(request.pages)] = page
        request.pages.append(page)
        request.promised -= 1

    def _prefix_limit(self, request: Request) -> int:
        """The most leading pages `request` may take from the cache: its last context
        token is always computed (its logits are needed), and so are the prompt
        positions it asked to have scored (until they are)."""
        limit = (len(request.context) - 1) // self.page_size
        if request.score is not None and request.scores_missing:
            limit = min(limit, (len(request.prompt) - 1 - request.score[0]) // self.page_size)
        return limit

    def _reuse_prefix(self, request: Request) -> None:
        """Start `request` after its longest cached prefix (`_prefix_limit`)."""
        assert request.slot is not None
        shared = self.pool.share(request.context, self._prefix_limit(request), namespace=request.namespace)
        request.looked_up, request.pages, request.promised = True, shared, request.promised - len(shared)
        self.table[request.slot, : len(shared)] = shared
        request.prefilled = len(shared) * self.page_size
        self.prompt_tokens += len(request.context)
        self.cached_tokens += request.prefilled

    def _sharing_in_flight(self, request: Request, others: list[Request]) -> bool:
        """Whether one of `others` (being prefilled) is computing full pages of
        `request`'s prefix that the cache does not hold yet: then `request` waits for
        them and shares them instead of computing them again."""
        ps, limit = self.page_size, self._prefix_limit(request)
        cached = self.pool.cached_pages(request.context, limit, namespace=request.namespace)
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

    def _plan_prefill(self) -> PrefillBatch | None:
        pending = []
        for r in sorted((r for r in self.slots if r is not None and not r.running), key=lambda r: r.admitted):
            if len(pending) == self.prefill_rows:
                break
            if r.looked_up or not self._sharing_in_flight(r, pending):
                pending.append(r)
        if not pending:
            return None
        for request in pending:
            if not request.looked_up:
                self._reuse_prefix(request)
        # One chunk for each of the oldest admitted requests: the smallest power of two (>= 16)
        # holding the longest remainder, up to prefill_chunk (a prompt after a cached prefix
        # costs a short chunk); rows padded to a power of two. Few shapes compile.
        longest = max(len(r.context) - r.prefilled for r in pending)
        C = min(self.prefill_chunk, max(self.min_chunk, 1 << (longest - 1).bit_length()))
        P = 1 << (len(pending) - 1).bit_length()
        rows = np.full((P,), self.max_seqs, np.int32)
        table = np.full((P, self.table.shape[1]), self.num_pages, np.int32)
        tokens = np.zeros((P, C), np.int32)
        start, length = np.zeros((P,), np.int32), np.ones((P,), np.int32)
        scoring = [r for r in pending if r.scores_missing]
        targets = np.full((P, C), -1, np.int32) if scoring else None
        for i, r in enumerate(pending):
            assert r.slot is not None
            end = min(r.prefilled + C, len(r.context))
            if targets is not None and r.score is not None and r.scores_missing:  # position t: on token t + 1
                for t in range(max(r.prefilled, len(r.prompt) - 1 - r.score[0]), min(end, len(r.prompt) - 1)):
                    targets[i, t - r.prefilled] = r.prompt[t + 1]
            while len(r.pages) * self.page_size < end:
                self._take_page(r)  # (promised on admission)
            tokens[i, : end - r.prefilled] = r.context[r.prefilled : end]
            table[i], start[i], length[i] = self.table[r.slot], r.prefilled, len(r.context)
            rows[i] = r.slot if end == len(r.context) else self.max_seqs
            r.prefilled = end
        for r in pending:
            if r.running:
                self.pool.register(r.context, r.pages, namespace=r.namespace)  # later requests may share them
        top_k = self.scored_alternatives(max((r.score[1] for r in scoring if r.score is not None), default=0))
        self.prefill_chunks += 1
        return PrefillBatch(rows, table, tokens, start, length, self._adapter_ids(pending, P), tuple(pending), targets,
                            top_k)

    def _decoding(self) -> list[Request]:
        """The running requests short of their length, oldest first, each with a page
        for this step's token (handed out oldest first; preempted requests are left out)."""
        running = sorted((r for r in self.slots if r is not None and r.running and r.decoded < r.params.max_new_tokens),
                         key=lambda r: r.admitted)
        for r in running:  # a page for this step's token where the last one is full
            if r.slot is not None and (len(r.prompt) + r.decoded) // self.page_size >= len(r.pages):
                self._page_for(r)
        return [r for r in running if r.slot is not None]

    def _decode_batch(self, running: Sequence[Request], R: int | None = None) -> DecodeBatch | None:
        """A decode step of `running` (pages in hand), padded to `R` rows (`None`: the
        running count padded to a power of two, a few compiled shapes and no work for
        idle slots, or with `share_rows` their runs (`_runs`) so padded; then `None` if
        nothing runs)."""
        if R is None:
            if not running:
                return None
            layout = self._runs(running)
            if layout is not None:
                return self._laid_out(layout, self._bucket(len(layout)), self.share_rows)
            R = self._bucket(len(running))
        return self._laid_out(running, R)

    def _bucket(self, rows: int) -> int:
        """The decode rows that `rows` requests are padded to."""
        return min(self.max_seqs, max(self.min_rows, 1 << (rows - 1).bit_length()))

    def _laid_out(self, layout: Sequence[Request | None], R: int, share_rows: int = 0) -> DecodeBatch:
        """A decode step of the requests in `layout` (`None`: a padding row), padded to `R`
        rows; `share_rows > 1`: the layout is in runs of that many rows (`_runs`)."""
        rows = np.full((R,), self.max_seqs, np.int32)
        table = np.full((R, self.table.shape[1]), self.num_pages, np.int32)
        positions = np.zeros((R,), np.int32)
        generated = np.zeros((R,), np.int32)
        at = [i for i, r in enumerate(layout) if r is not None]
        requests = [r for r in layout if r is not None]
        for i, r in zip(at, requests):
            assert r.slot is not None
            position = len(r.prompt) + r.decoded  # where this step's token is written
            rows[i], table[i], positions[i], generated[i] = r.slot, self.table[r.slot], position, r.decoded
            r.pending += 1
        return DecodeBatch(tuple(requests), rows, table, positions, generated, self._adapter_ids(requests, R, at),
                           np.asarray(at, np.int32) if share_rows else None, share_rows)

    def _runs(self, running: Sequence[Request]) -> list[Request | None] | None:
        """`running` laid out in runs of `share_rows` rows, each of at least half as many
        requests whose first page is one page (the samples of a prompt, or requests of
        one cached system prompt) and padded with `None`, then, packed, the requests left
        over (padding rows cost decode rows: the MLP, LM head and sampler run on them).
        `None` if no run forms, or the layout does not fit the slots."""
        w = self.share_rows
        if w < 2:
            return None
        by_first: dict[int, list[Request]] = {}
        for r in running:
            by_first.setdefault(r.pages[0] if r.pages else -1 - r.id, []).append(r)
        layout: list[Request | None] = []
        alone: list[Request] = []
        for members in by_first.values():
            while len(members) >= max(2, w // 2):
                run, members = members[:w], members[w:]
                layout += run + [None] * (w - len(run))
            alone += members
        if not layout:
            return None
        layout += alone
        R = self._bucket(len(layout))
        return layout if len(layout) <= R and R % w == 0 else None

    def _adapter_ids(self, requests: Sequence[Request], rows: int,
                     at: Sequence[int] | None = None) -> np.ndarray | None:
        """Each row's adapter (request `i` in row `at[i]`, default `i`; padding rows:
        adapter 0), or `None` without a bank."""
        if not self.bank:
            return None
        ids = np.zeros((rows,), np.int32)
        ids[list(range(len(requests))) if at is None else list(at)] = [r.adapter or 0 for r in requests]
        return ids

    def _release(self, request: Request) -> None:
        """Free the request's slot and pages (its full pages stay cached by their tokens)."""
        assert request.slot is not None
        self.pool.register(request.written, request.pages, namespace=request.namespace)
        self.pool.release(request.pages)
        self.pool.unpromise(request.promised)
        self.table[request.slot] = self.num_pages
        self.slots[request.slot] = None
        request.slot = None

    def _finish(self, request: Request, reason: str | None) -> None:
        """Free the request (running, or preempted and waiting); keep its result unless
        it was cancelled (`reason` None)."""
        request.ended = True
        if request.slot is None:
            self.waiting.remove(request)
        else:
            self._release(request)
        if reason is not None:
            assert reason in STOP_REASONS
            self.finished[request.id] = Generation(request.tokens, request.logprobs, reason, _prompt_scores(request))


def _prompt_scores(request: Request) -> PromptScores | None:
    """The scores `request` asked for, in prompt order (`None` if it asked for none)."""
    if request.score is None:
        return None
    rows, k = [request.scores[t] for t in sorted(request.scores)], request.score[1]
    return PromptScores(np.asarray([r[0] for r in rows], np.float32),
                        np.asarray([r[1] for r in rows], np.int32).reshape(len(rows), k),
                        np.asarray([r[2] for r in rows], np.float32).reshape(len(rows), k))
