"""The Tinker service's futures and its training thread.

`Futures` hands out request ids (carrying the server's instance, so a request from
before a restart is told so) and keeps their answers for `retrieve_future`.
`TrainingWorker` runs the training calls one after another on one thread; calls
queued back to back that can share a batch (`Batchable` of one key) run as one.
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import queue
import secrets
import threading
from collections.abc import Callable
from typing import Any

from ..core.log import logger
from .tinker_wire import BadRequest


class Futures:
    """Request ids and their futures (answered by `retrieve_future`)."""

    def __init__(self, keep: int = 4096):
        self.instance = secrets.token_hex(4)
        self._ids = itertools.count(1)
        self._items: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def new(self) -> tuple[str, concurrent.futures.Future]:
        request_id = f"{self.instance}-{next(self._ids)}"
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._items[request_id] = future
            while len(self._items) > self._keep:  # drop the oldest answered ones
                oldest, f = next(iter(self._items.items()))
                if not f.done():
                    break
                self._items.pop(oldest)
        return request_id, future

    def get(self, request_id: str) -> concurrent.futures.Future:
        with self._lock:
            future = self._items.get(request_id)
        if future is not None:
            return future
        if not request_id.startswith(self.instance + "-"):
            raise BadRequest(f"request {request_id} was made before the server restarted; its result is lost: "
                             "send it again")
        raise BadRequest(f"unknown request id {request_id}")


@dataclasses.dataclass(frozen=True)
class Batchable:
    """A training call that may run in one batch with the calls queued right after it
    that share its `key` (`TrainingWorker` calls `run_batch` with all of their items)."""

    key: Any
    item: Any
    future: concurrent.futures.Future


class TrainingWorker:
    """One thread running the training calls in order. Consecutive `Batchable` calls of
    one key (forward/backward passes of one loss, from any clients) run as one batch:
    `run_batch(items)` returns each one's result or exception."""

    def __init__(self, run_batch: Callable[[list], list] | None = None, max_batch: int = 64):
        self._inbox: queue.Queue = queue.Queue()
        self._run_batch, self._max_batch = run_batch, max_batch
        self._next = None  # taken from the inbox but not of the batch before it
        self._thread = threading.Thread(target=self._run, name="eqx_tx-tinker-train", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any] | Batchable, future: concurrent.futures.Future | None = None) -> None:
        self._inbox.put(fn if isinstance(fn, Batchable) else (fn, future))

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    def _take(self):
        item, self._next = (self._next, None) if self._next is not None else (self._inbox.get(), None)
        return item

    def _run(self) -> None:
        while (item := self._take()) is not None:
            if isinstance(item, Batchable):
                self._batch(item)
                continue
            fn, future = item
            _answer(future, fn)

    def _batch(self, first: Batchable) -> None:
        batch = [first]
        while len(batch) < self._max_batch:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not (isinstance(item, Batchable) and item.key == first.key):
                self._next = item
                break
            batch.append(item)
        assert self._run_batch is not None
        try:
            results = self._run_batch([b.item for b in batch])
        except Exception as e:  # noqa: BLE001 - every call of the batch gets it
            logger.exception("a batch of Tinker training calls failed")
            results = [e] * len(batch)
        for b, result in zip(batch, results):
            if isinstance(result, BaseException):
                b.future.set_exception(result)
            else:
                b.future.set_result(result)


def _answer(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BadRequest as e:
        future.set_exception(e)
    except Exception as e:  # noqa: BLE001 - the caller gets it; the worker serves on
        logger.exception("a Tinker training call failed")
        future.set_exception(e)
