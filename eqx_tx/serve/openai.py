"""An OpenAI-compatible HTTP server over `eqx_tx.Engine` (FastAPI; the `serve` extra).

`/v1/completions` (a prompt, or a list of prompts: text or token ids),
`/v1/chat/completions` (the checkpoint's chat template) and `/v1/models`, streaming
(server-sent events, with `stream_options.include_usage`) or not, with `n`,
`max_tokens` (0: no tokens), `temperature`, `top_p`, `top_k` (an extra body field),
`stop` (strings), `seed`, `logprobs` (each sampled token's log-probability and, up
to the engine's `max_top_logprobs`, the most likely alternatives) and `echo` (the
prompt first; with `logprobs`, its tokens scored by the engine's prefill). With a LoRA
adapter bank, each adapter is served as a model of its own name and requests for
different adapters share the engine's batches. `GET /health` answers 200 while the
engine runs; `GET /metrics` gives the counters of `eqx_tx.serve.metrics` in
Prometheus' text format. Each answered request is logged in one line (prompt and
output tokens, time to first token, tokens/s).

One thread owns the engine (`eqx_tx.serve.loop.EngineLoop`): requests reach it
through a typed inbox, it steps while any request is waiting or running, and each
request's tokens go back to its handler's asyncio queue. Every error, bad JSON and
unknown routes included, is answered in OpenAI's error format and the engine keeps
serving; a client that disconnects has its requests cancelled, so their pages are
freed at once; a failing engine step answers every open request with a 500 error.
The final text of a choice is the decoding of all its tokens (up to a stop string).
"""

import asyncio
import concurrent.futures
import dataclasses
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from ..core.log import logger
from ..infer.sampling import SamplingParams
from ..infer.scheduler import TokenEvent
from ..infer.steps import PromptScores
from ..infer.text import Message, Tokenizer
from .loop import EngineFailure, EngineLoop, EngineStopped
from .metrics import ServerMetrics

MAX_CHOICES = 128  # n x prompts of one request (OpenAI's bound on n)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


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
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatRequest(_Sampled):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


@dataclasses.dataclass
class _Choice:
    """One sample's progress: tokens, text so far, and where a stop string cut it."""

    prompt: int  # which prompt of the request it continues
    decode: Callable[[int], str]  # the text each new token adds (`Tokenizer.decode_stream`)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)  # alternatives per token
    text: str = ""
    sent: int = 0  # characters already streamed
    finish_reason: str | None = None


class _Job:
    """The engine requests of one HTTP request (`n` per prompt) and their tokens, as text.

    Choice `p * n + j` is sample `j` of prompt `p`, as OpenAI numbers them. With
    `score = k` (echo with logprobs) each prompt's tokens are scored with their `k` most
    likely alternatives by its first sample's prefill, in the engine (with `max_tokens=0`
    by a request of one token of its own, which is not answered)."""

    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer, prompts: list[list[int]], params: SamplingParams | None,
                 n: int, stop: list[str], adapter: int | None, score: int | None = None):
        self.loop, self.stop, self.tokenizer = loop, stop, tokenizer
        self.prompts = prompts
        self.arrived = time.perf_counter()
        self.first_token: float | None = None
        self.choices = [_Choice(p, tokenizer.decode_stream()) for p in range(len(prompts)) for _ in range(n)]
        self._longest_stop = max(map(len, stop), default=0)
        self.scores: list[PromptScores | None] = [None] * len(prompts)  # (one-token prompts have none)
        self._unscored = {p for p, prompt in enumerate(prompts) if score is not None and len(prompt) >= 2}
        self._events: asyncio.Queue[tuple[int, TokenEvent | EngineFailure]] = asyncio.Queue()
        # Request `r` (its events' index) is choice `r`'s, or from `len(choices)` on one
        # that only scores prompt `_scored_alone[r - len(choices)]`.
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._scored_alone: list[int] = []
        aio = asyncio.get_running_loop()

        def submit(r: int, prompt: int, params: SamplingParams, sample: int, scored: bool) -> None:
            how = (len(prompts[prompt]) - 1, score) if scored and score is not None else None
            self._futures[r] = loop.submit(prompts[prompt], params, sample,
                                           lambda e: aio.call_soon_threadsafe(self._events.put_nowait, (r, e)),
                                           adapter, score=how)

        if params is None:  # max_tokens=0: nothing to generate
            for choice in self.choices:
                choice.finish_reason = "length"
            for p in sorted(self._unscored):
                submit(len(self.choices) + len(self._scored_alone), p, SamplingParams(max_new_tokens=1), 0, True)
                self._scored_alone.append(p)
        else:
            for i, c in enumerate(self.choices):
                submit(i, c.prompt, params, i % n, i % n == 0 and c.prompt in self._unscored)
        self.ids: dict[int, int] = {}

    async def start(self) -> None:
        """Wait until the engine took every request (`ApiError` 400 if it refused one)."""
        try:
            for r, future in self._futures.items():
                self.ids[r] = await asyncio.wrap_future(future)
        except ValueError as e:
            self.cancel()
            raise ApiError(400, str(e), kind="invalid_request_error") from e
        except EngineStopped as e:
            raise ApiError(503, str(e), kind="server_error") from e

    def cancel(self) -> None:
        """Cancel every unfinished request (once the engine has taken it)."""
        for r, future in self._futures.items():
            if (self.choices[r].finish_reason is None if r < len(self.choices)
                    else self._scored_alone[r - len(self.choices)] in self._unscored):
                future.add_done_callback(lambda f: f.exception() is None and self.loop.cancel(f.result()))

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices) and not self._unscored

    def _cut(self, choice: _Choice, start: int) -> bool:
        """Cut `choice.text` at the first stop string ending after `start`; whether one did."""
        cut = min((i for i in (choice.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            choice.text, choice.finish_reason = choice.text[:cut], "stop"
        return cut >= 0

    async def next(self) -> int | None:
        """Take one token event; returns the index of the choice it extended (`None`
        for a request that only scored its prompt)."""
        i, event = await self._events.get()
        if isinstance(event, EngineFailure):
            raise ApiError(500, f"the engine failed while running this request: {event.message}",
                           kind="server_error")
        if event.prompt_scores is not None:  # (with the first token of the request that scored it)
            prompt = self.choices[i].prompt if i < len(self.choices) else self._scored_alone[i - len(self.choices)]
            self.scores[prompt] = event.prompt_scores
            self._unscored.discard(prompt)
        if i >= len(self.choices):
            return None
        if self.first_token is None:
            self.first_token = time.perf_counter()
        choice = self.choices[i]
        if choice.finish_reason is not None:  # cut by a stop string; late tokens are dropped
            return i
        choice.tokens.append(event.token)
        choice.logprobs.append(event.logprob)
        choice.top.append(event.top_logprobs)
        # Only the new text is decoded, and only where a stop string may now end is
        # searched: constant work per token, however long the answer.
        start = max(0, len(choice.text) - self._longest_stop + 1)
        choice.text += choice.decode(event.token)
        if self._cut(choice, start):
            request_id = self.ids.get(i)
            if event.finish_reason is None and request_id is not None:
                self.loop.cancel(request_id)
        elif event.finish_reason is not None:
            # The incremental decoder holds back an incomplete character; the answer is
            # the decoding of every token (cut again where a stop string now ends).
            start = max(0, len(choice.text) - self._longest_stop + 1)
            choice.text = self.tokenizer.decode(choice.tokens)
            if not self._cut(choice, start):
                choice.finish_reason = event.finish_reason
        return i

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sampling(body: CompletionRequest | ChatRequest, max_tokens: int, prompts: int = 1) -> SamplingParams | None:
    """The request's sampling settings (`None` for `max_tokens=0`: no tokens)."""
    if not 1 <= body.n <= MAX_CHOICES // prompts:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES // prompts}]" +
                       (f" ({MAX_CHOICES} choices over {prompts} prompts)" if prompts > 1 else "") +
                       f", got {body.n}", "n")
    if max_tokens < 0:
        raise ApiError(400, f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    if max_tokens == 0:
        return None
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
              adapters: Mapping[str, int] | None = None, *, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app serving `loop`'s engine as `model_name`.

    With `adapters` (the engine's model holds a LoRA bank) it serves each
    `name -> slot` of it as model `name`, and `model_name` as `adapters[model_name]`.
    `metrics`: where requests are counted (default: a new `ServerMetrics`)."""
    slots: dict[str, int | None] = {model_name: None} if adapters is None else dict(adapters)
    if model_name not in slots:
        raise ValueError(f"adapters {sorted(slots)} name no adapter for the served model {model_name!r}")
    counters = metrics or ServerMetrics()
    max_top = loop.engine.config.max_top_logprobs
    app = FastAPI(title="eqx_tx")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        counters.finished(request.url.path, e.status)
        return _error(e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        counters.finished(request.url.path, 400)
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'invalid')}")
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                      first.get("msg", "invalid request"), where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        counters.finished(request.url.path, e.status_code)
        if e.status_code == 404:
            return _error(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found")
        if e.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        return _error(e.status_code, str(e.detail))

    @app.get("/health")
    async def health():
        if not loop.running:
            return _error(503, f"the engine loop has stopped: {loop.failure or 'shut down'}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        stats = await asyncio.to_thread(loop.call, lambda engine: engine.stats()) if loop.running else {}
        return PlainTextResponse(counters.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "eqx_tx"}
                                           for name in slots]}

    def adapter_of(name: str) -> int | None:
        if name not in slots:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {', '.join(map(repr, slots))}",
                           "model", "model_not_found")
        return slots[name]

    def check_top(k: int | None, param: str) -> int:
        if k is None or k == 0:
            return 0
        if not 0 <= k <= max_top:
            raise ApiError(400, f"{param} must be in [0, {max_top}] (the most likely alternatives of each token; "
                                f"the server's --max-top-logprobs), got {k}", param)
        return k

    def report(ident: str, endpoint: str, model: str, job: _Job, status: int = 200, *, count: bool = True) -> None:
        """Log the answered request in one line and count it (`count=False`: the error
        handler counts it)."""
        now = time.perf_counter()
        usage = job.usage()
        ttft = None if job.first_token is None else job.first_token - job.arrived
        decode_time = now - (job.first_token or now)
        rate = (usage["completion_tokens"] - len(job.choices)) / decode_time if decode_time > 0 else 0.0
        if count:
            counters.finished(endpoint, status, prompt_tokens=usage["prompt_tokens"],
                              generated=usage["completion_tokens"], ttft=ttft, latency=now - job.arrived)
        reasons = ",".join(sorted({c.finish_reason or "cancelled" for c in job.choices}))
        logger.info(f"{ident} {model}: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} output tokens "
                    f"in {now - job.arrived:.2f} s (first token {0.0 if ttft is None else ttft:.3f} s, "
                    f"{rate:.1f} tokens/s after it), finish {reasons}, status {status}")

    async def run(job: _Job, ident: str, endpoint: str, body: _Sampled, chunk: Callable[[_Job, int, bool], dict],
                  final: Callable[[_Job], dict], chunk_object: str):
        """Answer `job`: `final(job)`, or streamed `chunk`s (and with
        `stream_options.include_usage`, a last chunk of `chunk_object` with the usage)."""
        model, stream = body.model, body.stream
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        await job.start()
        if not stream:
            try:
                while not job.done:
                    await job.next()
            except ApiError as e:
                report(ident, endpoint, model, job, e.status, count=False)
                raise
            finally:
                job.cancel()
            report(ident, endpoint, model, job)
            return final(job)

        async def events() -> AsyncIterator[str]:
            status = 200
            try:
                for i in range(len(job.choices)):
                    yield _sse(chunk(job, i, True))
                while not job.done:
                    try:
                        i = await job.next()
                    except ApiError as e:  # mid-stream: the error as the last event
                        status = e.status
                        yield _sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
                        return
                    if i is not None:
                        yield _sse(chunk(job, i, False))
                if include_usage:
                    yield _sse({"id": ident, "object": chunk_object, "created": int(time.time()), "model": model,
                                "choices": [], "usage": job.usage()})
                yield _sse("[DONE]")
            finally:  # also when the client went away mid-stream: free its pages
                job.cancel()
                report(ident, endpoint, model, job, status)

        return StreamingResponse(events(), media_type="text/event-stream")

    def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [[int(t) for t in prompt]]  # type: ignore[union-attr]  # one prompt of token ids
        else:
            prompts = [tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]  # type: ignore[union-attr]
                       for p in prompt]  # several
        if not prompts or any(not p for p in prompts):
            raise ApiError(400, "the prompt is empty" if len(prompts) < 2 else "a prompt of the list is empty",
                           "prompt")
        return prompts

    def echo_prompts(body: CompletionRequest, prompts: list[list[int]], job: _Job) -> list[tuple[str, dict]]:
        """With `echo`: each prompt's text and its tokens' logprobs entries (`None` for the
        first token: nothing precedes it), as the engine scored them (`_Job`)."""
        texts = [body.prompt] if isinstance(body.prompt, str) else (
            [p if isinstance(p, str) else tokenizer.decode(q) for p, q in zip(body.prompt, prompts)]
            if body.prompt and not isinstance(body.prompt[0], int) else [tokenizer.decode(prompts[0])])
        out = []
        for text, prompt, scores in zip(texts, prompts, job.scores):
            entries = {"tokens": [tokenizer.decode([t]) for t in prompt], "token_logprobs": None, "top_logprobs": None,
                       "text_offset": None}
            if body.logprobs is not None:
                lp, ids, values = (np.zeros(0), [], []) if scores is None else \
                    (scores.logprobs, scores.top_ids, scores.top_logprobs)
                entries["token_logprobs"] = [None] + [float(x) for x in lp]
                if body.logprobs:
                    entries["top_logprobs"] = [None] + [
                        {tokenizer.decode([int(t)]): float(v) for t, v in zip(row_ids, row)}
                        for row_ids, row in zip(ids, values)]
            out.append((text, entries))
        return out

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        adapter = adapter_of(body.model)
        top = check_top(body.logprobs, "logprobs")
        prompts = completion_prompts(body.prompt)
        params = _sampling(body, 16 if body.max_tokens is None else body.max_tokens, len(prompts))
        if body.echo and body.stream:
            raise ApiError(400, "echo is not supported with stream=true", "echo")
        score = top if body.echo and body.logprobs is not None else None
        limit = loop.engine.max_seq_len
        if score is not None and params is None and any(len(p) >= limit for p in prompts):
            raise ApiError(400, f"echo with max_tokens=0 scores a prompt in the engine, which also samples one token "
                                f"it does not answer: prompts of at most {limit - 1} tokens (max_seq_len {limit} - 1), "
                                f"got {max(map(len, prompts))}", "prompt")
        job = _Job(loop, tokenizer, prompts, params, body.n, _stops(body.stop), adapter, score)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(c: _Choice, since: int, echoed: list[tuple[str, dict]] | None) -> dict | None:
            if body.logprobs is None:
                return None
            tokens = c.tokens[since:]
            found = {"tokens": [tokenizer.decode([t]) for t in tokens], "token_logprobs": c.logprobs[since:],
                     "top_logprobs": [{tokenizer.decode([t]): v for t, v in alternatives[:top]}
                                      for alternatives in c.top[since:]] if top else None,
                     "text_offset": None}
            if echoed is not None:  # the prompt's tokens first (the first has no log-prob)
                before = echoed[c.prompt][1]
                found = {k: None if v is None or before[k] is None else before[k] + v for k, v in found.items()}
            return found

        def choice(job: _Job, i: int, delta: bool, echoed: list[tuple[str, dict]] | None = None) -> dict:
            """Choice `i`'s text and logprobs (`delta`: since the last chunk; `echoed`: the
            prompts' text and entries first, `echo_prompts`)."""
            c = job.choices[i]
            text = c.text[c.sent :] if delta else c.text
            if delta:
                c.sent = len(c.text)
            elif echoed is not None:
                text = echoed[c.prompt][0] + text
            return {"index": i, "text": text, "finish_reason": c.finish_reason,
                    "logprobs": logprobs(c, len(c.tokens) - 1 if delta else 0, echoed)}

        def chunk(job: _Job, i: int, first: bool) -> dict:
            c = {"index": i, "text": "", "finish_reason": None, "logprobs": None} if first else choice(job, i, True)
            return {"id": ident, "object": "text_completion", "created": created, "model": body.model, "choices": [c]}

        def final(job: _Job) -> dict:
            echoed = echo_prompts(body, prompts, job) if body.echo else None  # (scored by the time the job is done)
            return {"id": ident, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [choice(job, i, False, echoed) for i in range(len(job.choices))], "usage": job.usage()}

        return await run(job, ident, "/v1/completions", body, chunk, final, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        adapter = adapter_of(body.model)
        top = check_top(body.top_logprobs, "top_logprobs")
        if top and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        messages: list[Message] = body.messages  # type: ignore[assignment]
        try:
            prompt = tokenizer.encode_prompt(messages, chat=True)
        except Exception as e:  # no template, or the template rejected the messages
            raise ApiError(400, f"cannot render the chat: {e}", "messages") from e
        limit = loop.engine.max_seq_len - len(prompt)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling(body, max(limit, 1) if asked is None else asked)
        job = _Job(loop, tokenizer, [prompt], params, body.n, _stops(body.stop), adapter)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(c: _Choice, since: int) -> dict | None:
            if not body.logprobs:
                return None
            return {"content": [{"token": tokenizer.decode([t]), "logprob": v, "bytes": None,
                                 "top_logprobs": [{"token": tokenizer.decode([a]), "logprob": w, "bytes": None}
                                                  for a, w in alternatives[:top]]}
                                for t, v, alternatives in zip(c.tokens[since:], c.logprobs[since:], c.top[since:])]}

        def chunk(job: _Job, i: int, first: bool) -> dict:
            c = job.choices[i]
            if first:
                delta, lp = {"role": "assistant", "content": ""}, None
            else:
                delta, lp = {"content": c.text[c.sent :]}, logprobs(c, len(c.tokens) - 1)
                c.sent = len(c.text)
            finish = None if first else c.finish_reason
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        def final(job: _Job) -> dict:
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs(c, 0), "finish_reason": c.finish_reason}
                       for i, c in enumerate(job.choices)]
            return {"id": ident, "object": "chat.completion", "created": created, "model": body.model,
                    "choices": choices, "usage": job.usage()}

        return await run(job, ident, "/v1/chat/completions", body, chunk, final, "chat.completion.chunk")

    return app
