"""The engine's thread: one owner of `eqx_tx.Engine`, fed through a typed inbox.

HTTP handlers run on an asyncio loop; the engine steps on its own thread. Handlers
send messages (`Add`, `Cancel`, `Call`) to the inbox; the thread handles them,
steps while any request is waiting or running, and calls each request's listener
with its `TokenEvent`s.

A step that raises does not end the thread silently: every open request's listener
gets an `EngineFailure` (its handler answers with an error), every pending message's
future fails, and the engine is reset (`Engine.reset`: every request dropped, a fresh
page pool). Then the loop serves on, or, with `keep_serving=False`, stops and fails
every later message with the same error: no request ever waits forever.
"""

import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..core.log import logger
from ..infer.engine import Engine, TokenEvent
from ..infer.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """What a request's listener gets instead of its next token when an engine step failed."""

    request_id: int
    message: str


Listener = Callable[[TokenEvent | EngineFailure], object]


@dataclasses.dataclass(frozen=True)
class Add:
    """Queue a request; the future gets its id (or the engine's `ValueError`)."""

    prompt: list[int]
    params: SamplingParams
    sample: int
    adapter: int | None
    listener: Listener
    future: concurrent.futures.Future
    score: tuple[int, int] | None = None  # (last n prompt tokens, top k): `Engine.add(score_last_n=...)`


@dataclasses.dataclass(frozen=True)
class Cancel:
    """Stop a request (its client went away or a stop string ended it)."""

    request_id: int


@dataclasses.dataclass(frozen=True)
class Call:
    """Run `fn(engine)` on the engine's thread; the future gets its result."""

    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes a waiting thread (to stop it)."""


Message = Add | Cancel | Call | Wake


class EngineStopped(RuntimeError):
    """The engine loop is not running (stopped, or ended by a failing step)."""


class EngineLoop:
    """Runs `engine` in a background thread; thread-safe `submit`, `cancel` and `call`.

    **Arguments:** the engine; `keep_serving`: after a failing step, reset the engine
    and go on (default) or stop.
    """

    def __init__(self, engine: Engine, *, keep_serving: bool = True):
        self.engine = engine
        self.keep_serving = keep_serving
        self.failure: str | None = None  # why the loop stopped, if a step ended it
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._listeners: dict[int, Listener] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="eqx_tx-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, sample: int, listener: Listener,
               adapter: int | None = None, score: tuple[int, int] | None = None) -> concurrent.futures.Future:
        """Queue a request (with `adapter` of a LoRA bank; `score = (n, k)`: its last `n`
        prompt tokens scored, on its first token's event); the future gives its id (or
        the engine's `ValueError`, or `EngineStopped`), and `listener` is called from
        the engine thread with each of its tokens (or an `EngineFailure`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(Add(prompt, params, sample, adapter, listener, future, score))
        return future

    def cancel(self, request_id: int) -> None:
        self._send(Cancel(request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` in the engine thread and return its result (for inspection)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(Call(fn, future))
        return future.result()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._inbox.put(Wake())
        self._thread.join()

    def _send(self, message: Message) -> None:
        self._inbox.put(message)
        if (self._stopped or not self.running) and threading.current_thread() is not self._thread:
            # The thread is ending (or ended): once it has, fail what it left (this message too).
            self._thread.join()
            self._fail_pending()

    def _stopped_error(self) -> EngineStopped:
        return EngineStopped("the engine loop has stopped" + (f" after a failing step: {self.failure}"
                                                              if self.failure else ""))

    def _fail_pending(self) -> None:
        """Fail every message still in the inbox."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, (Add, Call)) and not message.future.done():
                message.future.set_exception(self._stopped_error())

    def _handle(self, message: Message) -> None:
        if isinstance(message, Add):
            try:
                n, k = message.score or (None, 0)
                request_id = self.engine.add(message.prompt, message.params, sample=message.sample,
                                             adapter=message.adapter, score_last_n=n, score_top_k=k)
            except Exception as e:  # noqa: BLE001 - the request's own answer (ValueError: bad input)
                message.future.set_exception(e)
                return
            self._listeners[request_id] = message.listener
            message.future.set_result(request_id)
        elif isinstance(message, Cancel):
            self.engine.cancel(message.request_id)
            self._listeners.pop(message.request_id, None)
        elif isinstance(message, Call):
            try:
                message.future.set_result(message.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - the caller gets it
                message.future.set_exception(e)

    def _step_failed(self, error: Exception) -> None:
        """Answer every open request with the error, reset the engine."""
        message = f"{type(error).__name__}: {error}"
        logger.exception("engine step failed; %s", "every open request is answered with the error and the engine "
                         "is reset" if self.keep_serving else "the server stops serving")
        listeners, self._listeners = self._listeners, {}
        for request_id, listener in listeners.items():
            try:
                listener(EngineFailure(request_id, message))
            except Exception:  # noqa: BLE001 - one broken handler must not stop the others
                logger.exception("a listener failed while being told of the failure")
        self.engine.reset()
        if not self.keep_serving:
            self.failure = message
            self._stopped = True

    def _run(self) -> None:
        try:
            while not self._stopped:
                try:  # block only when there is nothing to step
                    self._handle(self._inbox.get(block=not self.engine.has_work()))
                    while True:
                        self._handle(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if self._stopped or not self.engine.has_work():
                    continue
                try:
                    events = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a failing step must not leave handlers waiting forever
                    self._step_failed(e)
                    continue
                for event in events:
                    listener = self._listeners.get(event.request_id)
                    if listener is not None:
                        listener(event)
                    if event.finish_reason is not None:
                        self._listeners.pop(event.request_id, None)
                        self.engine.result(event.request_id)  # the handler has every token
        finally:
            self._fail_pending()
