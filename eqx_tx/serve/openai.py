"""An OpenAI-compatible HTTP server over `eqx_tx.Engine` (FastAPI; the `serve` extra).

`/v1/completions`, `/v1/chat/completions` (the checkpoint's chat template) and
`/v1/models`, streaming (server-sent events) or not, with `n`, `max_tokens`,
`temperature`, `top_p`, `top_k` (an extra body field), `stop` (strings), `seed`
and `logprobs` (the sampled token's log-probability; no alternatives). With a
LoRA adapter bank, each adapter is served as a model of its own name and requests
for different adapters share the engine's batches.

One thread owns the engine (`eqx_tx.serve.loop.EngineLoop`): requests reach it
through a typed inbox, it steps while any request is waiting or running, and each
request's tokens go back to its handler's asyncio queue. A bad request gets a 4xx
answer in OpenAI's error format and the engine keeps serving; a client that
disconnects has its requests cancelled, so their pages are freed at once; a failing
engine step answers every open request with a 500 error.
"""

import asyncio
import dataclasses
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..infer.scheduler import TokenEvent
from .loop import EngineFailure, EngineLoop, EngineStopped
from ..infer.sampling import SamplingParams
from ..infer.text import Message, Tokenizer


class _Sampled(BaseModel):
    """The fields both endpoints share (unknown fields are ignored, as OpenAI's
    optional ones we do not implement)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Sampled):
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None


class ChatRequest(_Sampled):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


@dataclasses.dataclass
class _Choice:
    """One sample's progress: tokens, text so far, and where a stop string cut it."""

    decode: Callable[[int], str]  # the text each new token adds (`Tokenizer.decode_stream`)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters already streamed
    finish_reason: str | None = None


class _Job:
    """The `n` engine requests of one HTTP request and their tokens, as text."""

    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams, n: int,
                 stop: list[str], adapter: int | None):
        self.loop, self.stop = loop, stop
        self.prompt = prompt
        self.choices = [_Choice(tokenizer.decode_stream()) for _ in range(n)]
        self._longest_stop = max(map(len, stop), default=0)
        self.ids: list[int | None] = [None] * n
        self.failed: str | None = None
        self._events: asyncio.Queue[tuple[int, TokenEvent | EngineFailure]] = asyncio.Queue()
        aio = asyncio.get_running_loop()
        self._futures = [
            loop.submit(prompt, params, j, lambda e, j=j: aio.call_soon_threadsafe(self._events.put_nowait, (j, e)),
                        adapter)
            for j in range(n)
        ]

    async def start(self) -> None:
        """Wait until the engine took every request (`ApiError` 400 if it refused one)."""
        try:
            for j, future in enumerate(self._futures):
                self.ids[j] = await asyncio.wrap_future(future)
        except ValueError as e:
            self.cancel()
            raise ApiError(400, str(e), kind="invalid_request_error") from e
        except EngineStopped as e:
            raise ApiError(503, str(e), kind="server_error") from e

    def cancel(self) -> None:
        """Cancel every unfinished request (once the engine has taken it)."""
        for choice, future in zip(self.choices, self._futures):
            if choice.finish_reason is None:
                future.add_done_callback(lambda f: f.exception() is None and self.loop.cancel(f.result()))

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def next(self) -> int:
        """Take one token event; returns the index of the choice it extended."""
        j, event = await self._events.get()
        if isinstance(event, EngineFailure):
            self.failed = event.message
            raise ApiError(500, f"the engine failed while running this request: {event.message}",
                           kind="server_error")
        choice = self.choices[j]
        if choice.finish_reason is not None:  # cut by a stop string; late tokens are dropped
            return j
        choice.tokens.append(event.token)
        choice.logprobs.append(event.logprob)
        # Only the new text is decoded, and only where a stop string may now end is
        # searched: constant work per token, however long the answer.
        start = max(0, len(choice.text) - self._longest_stop + 1)
        choice.text += choice.decode(event.token)
        cut = min((i for i in (choice.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            choice.text, choice.finish_reason = choice.text[:cut], "stop"
            request_id = self.ids[j]
            if event.finish_reason is None and request_id is not None:
                self.loop.cancel(request_id)
        elif event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        return j

    def usage(self) -> dict:
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                "total_tokens": len(self.prompt) + completion}


def _sampling(body: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    if body.n < 1:
        raise ApiError(400, f"n must be >= 1, got {body.n}", "n")
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    seed = body.seed if body.seed is not None else random.randrange(2**31)
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                              top_p=body.top_p, seed=seed % 2**32)
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop: up to 4 non-empty strings", "stop")
    return stops


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def build_app(loop: EngineLoop, tokenizer: Tokenizer, model_name: str,
              adapters: Mapping[str, int] | None = None) -> FastAPI:
    """The FastAPI app serving `loop`'s engine as `model_name`.

    With `adapters` (the engine's model holds a LoRA bank) it serves each
    `name -> slot` of it as model `name`, and `model_name` as `adapters[model_name]`."""
    slots: dict[str, int | None] = {model_name: None} if adapters is None else dict(adapters)
    if model_name not in slots:
        raise ValueError(f"adapters {sorted(slots)} name no adapter for the served model {model_name!r}")
    app = FastAPI(title="eqx_tx")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return _error(e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", where or None)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "eqx_tx"}
                                           for name in slots]}

    def adapter_of(name: str) -> int | None:
        if name not in slots:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {', '.join(map(repr, slots))}",
                           "model", "model_not_found")
        return slots[name]

    async def run(job: _Job, chunk: Callable[[_Job, int, bool], dict], final: Callable[[_Job], dict],
                  stream: bool):
        await job.start()
        if not stream:
            try:
                while not job.done:
                    await job.next()
            finally:
                job.cancel()
            return final(job)

        async def events() -> AsyncIterator[str]:
            try:
                for j in range(len(job.choices)):
                    yield _sse(chunk(job, j, True))
                while not job.done:
                    try:
                        j = await job.next()
                    except ApiError as e:  # mid-stream: the error as the last event
                        yield _sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
                        return
                    yield _sse(chunk(job, j, False))
                yield _sse("[DONE]")
            finally:  # also when the client went away mid-stream: free its pages
                job.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        adapter = adapter_of(body.model)
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        params = _sampling(body, body.max_tokens or 16)
        job = _Job(loop, tokenizer, prompt, params, body.n, _stops(body.stop), adapter)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(job: _Job, j: int, delta: bool) -> dict:
            c = job.choices[j]
            text = c.text[c.sent :] if delta else c.text
            if delta:
                c.sent = len(c.text)
            out = {"index": j, "text": text, "finish_reason": c.finish_reason, "logprobs": None}
            if body.logprobs is not None:
                tokens = c.tokens[-1:] if delta else c.tokens
                values = c.logprobs[-1:] if delta else c.logprobs
                out["logprobs"] = {"tokens": [tokenizer.decode([t]) for t in tokens], "token_logprobs": values,
                                   "top_logprobs": None, "text_offset": None}
            return out

        def chunk(job: _Job, j: int, first: bool) -> dict:
            c = {"index": j, "text": "", "finish_reason": None, "logprobs": None} if first else choice(job, j, True)
            return {"id": ident, "object": "text_completion", "created": created, "model": body.model, "choices": [c]}

        def final(job: _Job) -> dict:
            return {"id": ident, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [choice(job, j, False) for j in range(len(job.choices))], "usage": job.usage()}

        return await run(job, chunk, final, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        adapter = adapter_of(body.model)
        messages: list[Message] = body.messages  # type: ignore[assignment]
        try:
            prompt = tokenizer.encode_prompt(messages, chat=True)
        except Exception as e:  # no template, or the template rejected the messages
            raise ApiError(400, f"cannot render the chat: {e}", "messages") from e
        limit = loop.engine.max_seq_len - len(prompt)
        params = _sampling(body, body.max_completion_tokens or body.max_tokens or max(limit, 1))
        job = _Job(loop, tokenizer, prompt, params, body.n, _stops(body.stop), adapter)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(tokens: list[int], values: list[float]) -> dict | None:
            if not body.logprobs:
                return None
            return {"content": [{"token": tokenizer.decode([t]), "logprob": v, "bytes": None, "top_logprobs": []}
                                for t, v in zip(tokens, values)]}

        def chunk(job: _Job, j: int, first: bool) -> dict:
            c = job.choices[j]
            if first:
                delta, lp = {"role": "assistant", "content": ""}, None
            else:
                delta, lp = {"content": c.text[c.sent :]}, logprobs(c.tokens[-1:], c.logprobs[-1:])
                c.sent = len(c.text)
            finish = None if first else c.finish_reason
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": j, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        def final(job: _Job) -> dict:
            choices = [{"index": j, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs(c.tokens, c.logprobs), "finish_reason": c.finish_reason}
                       for j, c in enumerate(job.choices)]
            return {"id": ident, "object": "chat.completion", "created": created, "model": body.model,
                    "choices": choices, "usage": job.usage()}

        return await run(job, chunk, final, body.stream)

    return app
