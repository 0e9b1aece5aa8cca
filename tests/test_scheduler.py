"""The engine's scheduler on its own, with no model: plans are checked against what
they must be (pages owned once, positions in order, admission and preemption as
documented), with a stand-in for the device that returns chosen tokens."""

import numpy as np
import pytest

from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.infer.scheduler import Scheduler

PAGE = 4


def _scheduler(**kw) -> Scheduler:
    settings = dict(max_seqs=3, num_pages=12, page_size=PAGE, pages_per_seq=8, prefill_chunk=8, prefill_rows=2)
    return Scheduler(**(settings | kw))


def _run(sched: Scheduler, pool: np.ndarray | None = None, token_of=lambda request_id, i: 7 + i % 5,
         max_steps=500, overlap=False, before_step=lambda step: None):
    """Step the scheduler to the end as a device would, on a simulated page pool: each
    plan's writes go to the pages its tables name. At every decode step each request's
    table must read back exactly its own prompt and tokens so far (what attention
    reads), and it must write into a page it owns. `pool`: the simulated pool of earlier
    runs (pages cached there hold what they held). `overlap`: each step is planned (and
    run) before the one before it is recorded, as the engine's `overlap_steps` does.
    `before_step(i)` runs before step `i` is planned. Returns the events by request and
    the number of positions prefilled."""
    if pool is None:
        pool = np.full((sched.num_pages + 1, PAGE), -1)  # the last row: writes that are dropped
    events: dict[int, list] = {}
    prefilled = 0
    in_flight = None

    def write(table_row, pos, token):
        pool[min(int(table_row[pos // PAGE]), sched.num_pages), pos % PAGE] = token

    def record(d, tokens):
        for e in sched.finish_step(d, tokens, np.zeros(len(d.rows), np.float32)):
            events.setdefault(e.request_id, []).append(e)

    for step in range(max_steps):
        if not sched.has_work():
            if in_flight is not None:  # rows only of requests that ended: nothing is recorded
                assert not [e for e in sched.finish_step(*in_flight, np.zeros(len(in_flight[0].rows)))]
            return events, prefilled
        before_step(step)
        plan = sched.schedule()
        assert plan.mixed == (sched.mixed and plan.prefill is not None)
        if plan.mixed:
            assert plan.decode is not None and plan.prefill is not None and len(plan.decode.rows) == sched.max_seqs
            assert not {r.id for r in plan.decode.requests} & {r.id for r in plan.prefill.requests}
        if plan.prefill is not None:
            b = plan.prefill
            P, C = b.tokens.shape
            assert P == len(b.rows) and P & (P - 1) == 0
            for row in range(P):
                for pos in range(int(b.start[row]), min(int(b.start[row]) + C, int(b.length[row]))):
                    if b.table[row, 0] != sched.num_pages:
                        assert b.table[row, pos // PAGE] != sched.num_pages, "prefill writes to an unallocated page"
                        prefilled += 1
                    write(b.table[row], pos, b.tokens[row, pos - int(b.start[row])])
        done, in_flight = in_flight, None
        if plan.decode is None:
            if done is not None:
                record(*done)
            continue
        d = plan.decode
        tokens = np.zeros(len(d.rows), np.int32)
        if d.share_rows:  # runs of requests sharing their first page, then the rest; every other row is padding
            assert len(d.rows) % d.share_rows == 0 and (d.rows[np.setdiff1d(np.arange(len(d.rows)), d.row_of())]
                                                        == sched.max_seqs).all()
        for i, r in zip(d.row_of(), d.requests):
            pos, g = int(d.positions[i]), int(d.generated[i])  # (the steps before, recorded or not)
            assert pos == len(r.prompt) + g and g == r.decoded - 1 and len(r.tokens) <= g < r.params.max_new_tokens
            assert d.table[i, pos // PAGE] != sched.num_pages, "a decode step writes to an unallocated page"
            read = [pool[int(d.table[i, t // PAGE]), t % PAGE] for t in range(pos)]
            assert read == r.prompt + [token_of(r.id, j) for j in range(g)], f"request {r.id} reads another context"
            tokens[i] = token_of(r.id, g)
            write(d.table[i], pos, tokens[i])
        if done is not None:
            record(*done)
        if overlap:
            in_flight = d, tokens
        else:
            record(d, tokens)
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_every_request_runs_to_its_length_through_a_pool_too_small_for_all(mixed, overlap):
    sched = _scheduler(mixed=mixed)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, int(rng.integers(1, 14))).tolist() for _ in range(7)]
    wanted = [int(rng.integers(1, 12)) for _ in prompts]
    ids = [sched.add(p, SamplingParams(max_new_tokens=n), sample=0, adapter=None, stop=()) for p, n in zip(prompts, wanted)]
    events, _ = _run(sched, overlap=overlap)
    for i, p, n in zip(ids, prompts, wanted):
        result = sched.finished.pop(i)
        assert result.tokens == [7 + k % 5 for k in range(n)] and result.stop_reason == "length"
        assert [e.token for e in events[i]] == result.tokens and events[i][-1].finish_reason == "length"
    assert sched.pool.referenced == 0 and not sched.has_work()
    assert sched.stats()["pages_in_use"] == 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_the_newest_request_is_preempted_and_resumes_where_it_stopped(mixed, overlap):
    # Two slots, 6 pages: two requests that each grow to 4 pages cannot both finish at once.
    sched = _scheduler(max_seqs=2, num_pages=6, pages_per_seq=4, mixed=mixed)
    a = sched.add([1] * 3, SamplingParams(max_new_tokens=12), sample=0, adapter=None, stop=())
    b = sched.add([2] * 3, SamplingParams(max_new_tokens=12), sample=0, adapter=None, stop=())
    events, _ = _run(sched, overlap=overlap)
    assert sched.preemptions >= 1
    for i in (a, b):
        assert sched.finished.pop(i).tokens == [7 + k % 5 for k in range(12)]
        assert len(events[i]) == 12


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_stop_token_ends_a_request_and_a_shared_prefix_is_computed_once(mixed, overlap):
    sched = _scheduler(prefill_rows=1, mixed=mixed)
    system = list(range(1, 13))  # three full pages
    first = sched.add(system + [20], SamplingParams(max_new_tokens=9), sample=0, adapter=None, stop=(8,))
    pool = np.full((sched.num_pages + 1, PAGE), -1)
    events, _ = _run(sched, pool, overlap=overlap)
    assert sched.finished.pop(first).tokens == [7, 8] and events[first][-1].finish_reason == "stop"
    second = sched.add(system + [21], SamplingParams(max_new_tokens=2), sample=0, adapter=None, stop=())
    _, prefilled = _run(sched, pool, overlap=overlap)
    assert sched.finished.pop(second).stop_reason == "length"
    assert prefilled == 1  # the three system pages came from the prefix cache
    assert sched.stats()["cached_tokens"] == 12
    # Another adapter's request shares nothing.
    sched.bank = True
    third = sched.add(system + [22], SamplingParams(max_new_tokens=1), sample=0, adapter=1, stop=())
    _, prefilled = _run(sched, pool, overlap=overlap)
    assert prefilled == 13 and sched.finished.pop(third).tokens == [7]


@pytest.mark.parametrize("mixed", [False, True])
def test_overlapped_steps_record_what_steps_one_by_one_record(mixed):
    """Each step planned and run before the one before it is recorded (the engine's
    `overlap_steps`), through a pool too small for all (preemptions, some of requests
    whose last token was not yet recorded) with tokens that stop requests early: every
    request ends with the tokens and reason of steps run one by one, every read is its
    own context (`_run`), and the pool ends empty. A request cancelled while its token
    is in flight gets no event after it, and the others run on."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 50, int(rng.integers(1, 14))).tolist() for _ in range(9)]
    wanted = [int(rng.integers(1, 16)) for _ in prompts]

    def token_of(request_id, i):
        return 3 if (3 * request_id + i) % 11 == 10 else 7 + i % 5  # 3 stops

    def run(overlap, cancel=None):
        sched = _scheduler(max_seqs=4, num_pages=10, mixed=mixed)
        for p, n in zip(prompts, wanted):
            sched.add(p, SamplingParams(max_new_tokens=n), sample=0, adapter=None, stop=(3,))
        hook = (lambda step: None) if cancel is None else (lambda step: step == cancel[1] and sched.cancel(cancel[0]))
        events, _ = _run(sched, token_of=token_of, overlap=overlap, before_step=hook)
        assert sched.pool.referenced == 0 and not sched.has_work() and sched.preemptions > 0
        return {i: [(e.token, e.finish_reason) for e in es] for i, es in events.items()}, sched

    one_by_one, _ = run(False)
    overlapped, sched = run(True)
    assert overlapped == one_by_one
    assert {es[-1][1] for es in one_by_one.values()} == {"stop", "length"}
    # Cancel request 0 at a step where it has recorded tokens and one in flight.
    cancelled, sched = run(True, cancel=(0, 6))
    assert 0 < len(cancelled[0]) < len(one_by_one[0]) and cancelled[0][-1][1] is None and 0 not in sched.finished
    assert {i: es for i, es in cancelled.items() if i} == {i: es for i, es in one_by_one.items() if i}


def test_samples_of_a_prompt_decode_in_runs_that_share_its_pages():
    """`share_rows`: the running samples of each prompt (their first page is one page)
    decode in runs of 4 rows, padded, the rest after them; every request still reads
    exactly its own context and gets its own tokens (`_run`)."""
    sched = _scheduler(max_seqs=16, num_pages=80, pages_per_seq=10, prefill_rows=4, share_rows=4)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50, 13).tolist() for _ in range(3)] + [rng.integers(0, 50, 3).tolist()]
    ids = {}
    for i, (p, n) in enumerate(zip(prompts, [3, 6, 1, 1])):
        for j in range(n):
            ids[sched.add(p, SamplingParams(max_new_tokens=int(rng.integers(2, 12))), sample=j, adapter=None,
                          stop=())] = i
    plans, schedule = [], sched.schedule
    sched.schedule = lambda: plans.append(schedule()) or plans[-1]
    events, _ = _run(sched, token_of=lambda request_id, i: 7 + (request_id + i) % 5)
    assert set(events) == set(ids)
    assert sched.stats()["prefill_chunks"] == sum(p.prefill is not None for p in plans) > 0
    shared = [p.decode for p in plans if p.decode is not None and p.decode.share_rows]
    assert shared, "no step ran in runs"
    runs = []
    for d in shared:
        by_row = dict(zip(d.row_of().tolist(), d.requests))
        runs += [[ids[by_row[i].id] if i in by_row else None for i in range(start, start + 4)]
                 for start in range(0, len(d.rows), 4)]
    assert [1, 1, 1, 1] in runs and [0, 0, 0, None] in runs, runs  # a prompt's samples, padded to a run
    for run in runs:  # one prompt's samples, or requests that share their first page with none
        live = [i for i in run if i is not None]
        assert len(set(live)) in (1, len(live)), runs


def test_a_run_holds_at_least_half_its_rows():
    """Runs of 8 rows: a prompt's 5 samples form a run (3 padding rows); another's 3
    would leave 5 of 8 rows padding, so they decode packed after the runs, beside a
    request alone (in runs of their own, these 17 rows would not fit 16 slots)."""
    sched = _scheduler(max_seqs=16, num_pages=80, pages_per_seq=10, prefill_rows=8, share_rows=8)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 50, 13).tolist() for _ in range(3)]
    ids = {sched.add(p, SamplingParams(max_new_tokens=6), sample=j, adapter=None, stop=()): i
           for i, (p, n) in enumerate(zip(prompts, [5, 3, 1])) for j in range(n)}
    plans, schedule = [], sched.schedule
    sched.schedule = lambda: plans.append(schedule()) or plans[-1]
    _run(sched)
    d = next(p.decode for p in plans if p.decode is not None and len(p.decode.requests) == 9)
    by_row = dict(zip(d.row_of().tolist(), d.requests))
    layout = [ids[by_row[i].id] if i in by_row else None for i in range(len(d.rows))]
    assert d.share_rows == 8 and layout == [0] * 5 + [None] * 3 + [1] * 3 + [2] + [None] * 4, layout


def test_cancel_frees_a_running_request_and_a_pool_too_small_is_refused():
    sched = _scheduler()
    i = sched.add([1, 2, 3], SamplingParams(max_new_tokens=5), sample=0, adapter=None, stop=())
    sched.schedule()
    assert sched.pool.referenced > 0
    sched.cancel(i)
    assert sched.pool.referenced == 0 and not sched.has_work() and i not in sched.finished
    with pytest.raises(ValueError, match="the pool has 12"):
        sched.add([1] * 40, SamplingParams(max_new_tokens=20), sample=0, adapter=None, stop=())


@pytest.mark.parametrize("mixed,min_chunk,min_rows", [(False, 16, 1), (True, 16, 1), (False, 32, 4)])
def test_step_shapes_cover_every_planned_shape(mixed, min_chunk, min_rows):
    """Every planned shape is one `step_shapes` lists, none below the smallest chunk and
    row count asked for (an accelerator's defaults: fewer shapes to compile)."""
    sched = _scheduler(max_seqs=5, prefill_chunk=32, prefill_rows=4, num_pages=64, pages_per_seq=16, mixed=mixed,
                       min_chunk=min_chunk, min_rows=min_rows)
    prefill_shapes, decode_rows = sched.step_shapes()
    assert min(C for C, _ in prefill_shapes) == min_chunk and min(decode_rows) == min_rows
    rng = np.random.default_rng(1)
    for _ in range(9):
        sched.add(rng.integers(0, 50, int(rng.integers(1, 40))).tolist(),
                  SamplingParams(max_new_tokens=int(rng.integers(1, 20))), sample=0, adapter=None, stop=())
    seen_prefill, seen_decode, mixed_plans = set(), set(), 0
    while sched.has_work():
        plan = sched.schedule()
        mixed_plans += plan.mixed
        if plan.prefill is not None:
            seen_prefill.add((plan.prefill.tokens.shape[1], plan.prefill.tokens.shape[0]))
        if plan.decode is not None:
            seen_decode.add(len(plan.decode.rows))
            sched.finish_step(plan.decode, np.full(len(plan.decode.rows), 7), np.zeros(len(plan.decode.rows)))
    assert seen_prefill <= set(prefill_shapes) and seen_decode <= set(decode_rows)
    assert len(seen_prefill) > 1 and len(seen_decode) > 1
    assert (mixed_plans > 0) == mixed


def test_scoring_batches_compute_few_alternative_counts():
    """A scoring prefill computes 0 alternatives, the engine's `max_top_logprobs` (here
    3) for requests asking up to that, or the next power of two; its requests ask for
    1, 3 and 0 here, and each keeps as many as it asked for."""
    sched = _scheduler(score_top_k=3, prefill_rows=4, num_pages=40)
    assert [sched.scored_alternatives(k) for k in range(10)] == [0, 3, 3, 3, 4, 8, 8, 8, 8, 16]
    assert sched.score_top_ks() == [0, 3] and _scheduler().score_top_ks() == [0]
    prompts = [list(range(1, 12)), list(range(3, 9)), list(range(2, 7))]
    for prompt, k in zip(prompts, (1, 3, 0)):
        sched.add(prompt, SamplingParams(max_new_tokens=1), sample=0, adapter=None, stop=(), score=(4, k))
    plan = sched.schedule()
    assert plan.prefill is not None and plan.prefill.top_k == 3
    C = plan.prefill.tokens.shape[1]
    P = len(plan.prefill.rows)
    scores = (np.zeros((P, C), np.float32), np.zeros((P, C, 3), np.int32), np.zeros((P, C, 3), np.float32))
    sched.finish_prefill(plan.prefill, scores)
    assert [next(iter(r.scores.values()))[1].shape for r in plan.prefill.requests] == [(1,), (3,), (0,)]


def test_a_mixed_step_decodes_the_requests_running_before_it():
    """Mixed: a context whose prefill ends in a step samples its first token the step
    after, beside the next context's prefill; separate passes sample it in the same step."""
    for mixed, first_tokens in ((False, [0, 1]), (True, [1, 2])):
        sched = _scheduler(prefill_rows=1, mixed=mixed)
        a = sched.add([1] * 5, SamplingParams(max_new_tokens=4), sample=0, adapter=None, stop=())
        b = sched.add([2] * 5, SamplingParams(max_new_tokens=4), sample=0, adapter=None, stop=())
        steps = []
        for _ in range(3):
            plan = sched.schedule()
            steps.append(plan)
            if plan.decode is not None:
                rows = len(plan.decode.rows)
                sched.finish_step(plan.decode, np.full(rows, 7), np.zeros(rows))
        decoded = [[r.id for r in p.decode.requests] if p.decode else [] for p in steps]
        assert [min(i for i, ids in enumerate(decoded) if r in ids) for r in (a, b)] == first_tokens, decoded
        assert [p.mixed for p in steps] == ([False] * 3 if not mixed else [True, True, False])
