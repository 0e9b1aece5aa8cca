"""The engine's thread: a failing engine step answers every open request with an
error (nothing waits forever), then the loop serves on, or stops and refuses later
requests with the same error."""

import concurrent.futures
import threading
import time

import jax
import pytest

import eqx_tx
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.models.presets import preset
from eqx_tx.serve.loop import EngineFailure, EngineLoop, EngineStopped

TIMEOUT = 120  # seconds: a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def model():
    return eqx_tx.init_model(preset("tiny"), key=jax.random.key(0))


class _Collector:
    """One request's events, and an event set when it finished or failed."""

    def __init__(self):
        self.events, self.ended = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, EngineFailure) or event.finish_reason is not None:
            self.ended.set()


def _submit(loop: EngineLoop, prompt: list[int], max_new: int) -> tuple[int, _Collector]:
    collector = _Collector()
    future = loop.submit(prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=()), 0,
                         collector)
    return future.result(timeout=TIMEOUT), collector


def _fail_next_step(engine: eqx_tx.Engine) -> threading.Event:
    """Make the engine's next step raise (once); the event is set when it did."""
    failed, step = threading.Event(), engine.step

    def failing_step():
        engine.step = step  # (an instance attribute: later steps run normally)
        failed.set()
        raise RuntimeError("injected device failure")

    engine.step = failing_step
    return failed


def test_a_failing_step_answers_every_open_request_and_the_loop_serves_on(model):
    engine = eqx_tx.Engine(model, max_seqs=2, max_tokens_in_cache=512, page_size=16)
    loop = EngineLoop(engine)
    try:
        # Hold the engine thread inside a call while the requests are queued, so that
        # the injected failure hits a step with all three open (two running, one waiting).
        gate = threading.Event()
        held = concurrent.futures.ThreadPoolExecutor(1).submit(loop.call, lambda e: gate.wait(TIMEOUT))
        collectors = [_Collector() for _ in range(3)]
        futures = [loop.submit([1, 2, 3 + i], SamplingParams(max_new_tokens=50, stop_token_ids=()), 0, c)
                   for i, c in enumerate(collectors)]
        failed = _fail_next_step(engine)
        gate.set()
        held.result(timeout=TIMEOUT)
        ids = [f.result(timeout=TIMEOUT) for f in futures]
        assert failed.wait(TIMEOUT)
        for request_id, collector in zip(ids, collectors):
            assert collector.ended.wait(TIMEOUT), f"request {request_id} was never answered"
            last = collector.events[-1]
            assert isinstance(last, EngineFailure) and last.request_id == request_id
            assert "injected device failure" in last.message
        assert not engine.has_work()
        # The loop goes on: a new request (a new id: a late cancel of a failed one hits
        # nothing) runs to the end and equals generate.
        loop.cancel(ids[0])
        request_id, collector = _submit(loop, [5, 6, 7], 4)
        assert request_id > max(ids)
        assert collector.ended.wait(TIMEOUT)
        tokens = [e.token for e in collector.events]
        want = eqx_tx.generate(model, [[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                  stop_token_ids=()))[0]
        assert tokens == want.tokens and collector.events[-1].finish_reason == "length"
    finally:
        loop.stop()


def test_keep_serving_false_stops_and_refuses_later_requests(model):
    engine = eqx_tx.Engine(model, max_seqs=2, max_tokens_in_cache=512, page_size=16)
    loop = EngineLoop(engine, keep_serving=False)
    try:
        failed = loop.call(_fail_next_step)
        request_id, collector = _submit(loop, [1, 2, 3], 20)
        assert failed.wait(TIMEOUT) and collector.ended.wait(TIMEOUT)
        assert isinstance(collector.events[-1], EngineFailure)
        deadline = time.monotonic() + TIMEOUT
        while loop.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not loop.running and loop.failure is not None and "injected device failure" in loop.failure
        later = loop.submit([1, 2], SamplingParams(max_new_tokens=2), 0, _Collector())
        with pytest.raises(EngineStopped, match="injected device failure"):
            later.result(timeout=TIMEOUT)
        with pytest.raises(EngineStopped):
            loop.call(lambda e: None)
    finally:
        loop.stop()
