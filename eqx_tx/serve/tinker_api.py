"""The Tinker API's HTTP routes (`/api/v1/...`) over a `TinkerService`.

The official `tinker` SDK runs unchanged against them (`TINKER_BASE_URL`). Long work
(model creation, forward/backward, optimizer steps, saves and loads, sampling) is
answered at once with a request id; the SDK polls `retrieve_future`, which waits up to
`WAIT_S` for the result before answering "try again". A bad request is answered 400
with a message naming the problem when it can be seen at once, or its future fails
with a user error; either way nothing of any run has changed, and the server serves on.
"""

import asyncio
import datetime
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as t

from ..infer.sampling import SamplingParams
from . import tinker_wire as wire
from .tinker_service import TinkerService
from .tinker_store import parse_path
from .tinker_wire import BadRequest

WAIT_S = 20.0
log = logging.getLogger("eqx_tx.tinker")


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=400)


def _checkpoint(entry: dict) -> dict:
    kind = {"weights": "training", "sampler_weights": "sampler"}[entry["kind"]]
    time = datetime.datetime.fromtimestamp(entry["created"], datetime.timezone.utc).isoformat()
    return {"checkpoint_id": f"{entry['kind']}/{entry['name']}", "checkpoint_type": kind, "time": time,
            "tinker_path": entry["path"], "size_bytes": entry["size"],
            "user_metadata": (entry["info"] or {}).get("user_metadata")}


def add_tinker_routes(app: FastAPI, service: TinkerService) -> None:
    """Serve `service` under `/api/v1` of `app`."""

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, e: BadRequest):
        return _bad(str(e))

    def future(request_id: str, model_id: str | None = None, **extra) -> dict:
        return {"request_id": request_id, "model_id": model_id, **extra}

    async def body(request: Request, model):
        try:
            return model.model_validate(await request.json())
        except ValueError as e:
            raise BadRequest(f"{model.__name__}: {e}") from None

    # -- service ------------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": True, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 3600, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.name, "max_context_length": service.max_seq_len,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await body(request, t.CreateSessionRequest)
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        try:
            service.heartbeat((await body(request, t.SessionHeartbeatRequest)).session_id)
        except BadRequest as e:  # finished, or from before a restart: the SDK stops its heartbeats
            return JSONResponse({"detail": str(e)}, status_code=410)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str):
        service.heartbeat(session_id)  # raises for an unknown session
        request_id, fut = service.futures.new()
        service.worker.submit(lambda: service.finish_session(session_id), fut)
        await asyncio.wrap_future(fut)
        return Response(status_code=204)

    # -- futures ------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        req = await body(request, t.FutureRetrieveRequest)
        try:
            fut = service.futures.get(req.request_id)
        except BadRequest as e:
            return {"error": str(e), "category": "user"}
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), WAIT_S)
        except asyncio.TimeoutError:
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        except BadRequest as e:
            return {"error": str(e), "category": "user"}
        except Exception as e:  # noqa: BLE001 - the request's own failure, logged where it ran
            return {"error": f"{type(e).__name__}: {e}", "category": "server"}
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return result

    # -- training runs ------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = await body(request, t.CreateModelRequest)
        service.check_base(req.base_model)
        if req.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {req.optimizer_config.type!r} is not supported (adamw only)")
        lora = req.lora_config or t.LoraConfig(rank=service.config.max_lora_rank)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        request_id = service.on_worker(lambda: service.create_model(
            model_id, req.session_id, rank=lora.rank, seed=lora.seed, train_attn=lora.train_attn,
            train_mlp=lora.train_mlp, train_unembed=lora.train_unembed, user_metadata=req.user_metadata))
        return future(request_id, model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return service.info((await body(request, t.GetInfoRequest)).model_id)

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request):
        req = await body(request, t.UnloadModelRequest)
        service.run(req.model_id)
        return future(service.on_worker(lambda: service.unload(req.model_id)), req.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        raw = wire.decompress(await request.body(), request.headers.get("content-encoding"))
        parsed = wire.parse_forward_backward(raw)
        service.run(parsed.model_id)
        return future(service.submit_forward_backward(parsed), parsed.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        raw = await request.json()
        req = await body(request, t.OptimStepRequest)
        service.run(req.model_id)
        params = raw.get("adam_params") or raw.get("optim_params") or {}
        if "type" in params and params["type"] != "adamw":
            raise BadRequest(f"optimizer {params['type']!r} is not supported (adamw only)")
        return future(service.on_worker(lambda: service.optim_step(req.model_id, params)), req.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        req = await body(request, t.SaveWeightsRequest)
        service.run(req.model_id)
        return future(service.on_worker(lambda: service.save_state(req.model_id, req.path, req.user_metadata)),
                      req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        req = await body(request, t.LoadWeightsRequest)
        parse_path(req.path)
        create = None
        if req.model_id is None:
            if req.session_id is None or req.model_seq_id is None:
                raise BadRequest("load_weights needs model_id, or session_id and model_seq_id")
            service.check_base(req.base_model)
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            create = {"session_id": req.session_id, "user_metadata": req.user_metadata}
        else:
            model_id = req.model_id
            service.run(model_id)
        return future(service.on_worker(lambda: service.load_state(model_id, req.path, req.optimizer, create=create)),
                      model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        req = await body(request, t.SaveWeightsForSamplerRequest)
        service.run(req.model_id)
        return future(service.on_worker(lambda: service.save_for_sampler(req.model_id, req.path)), req.model_id)

    # -- checkpoints --------------------------------------------------------------------

    @app.get("/api/v1/training_runs/{run}/checkpoints")
    async def list_checkpoints(run: str):
        return {"checkpoints": [_checkpoint(e) for e in service.store.list(run)]}

    @app.get("/api/v1/checkpoints")
    async def list_all_checkpoints():
        return {"checkpoints": [_checkpoint(e) for e in service.store.list()]}

    @app.delete("/api/v1/training_runs/{run}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run: str, checkpoint_id: str):
        service.store.delete(f"tinker://{run}/{checkpoint_id}")
        return Response(status_code=204)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        path = (await request.json()).get("tinker_path")
        entry = service.store.get(path)
        info = service.store.run(entry["run"]) or {}
        return {"base_model": service.name, "is_lora": True, "lora_rank": info.get("rank"),
                "train_unembed": info.get("train_unembed"), "train_mlp": info.get("train_mlp"),
                "train_attn": info.get("train_attn")}

    # -- sampling -----------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = await body(request, t.CreateSamplingSessionRequest)
        session_id = service.create_sampling_session(base_model=req.base_model, model_path=req.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        key = service.sampling_sessions.get(sampler_id)
        if key is None:
            raise BadRequest(f"unknown sampling session {sampler_id}")
        return {"sampler_id": sampler_id, "base_model": service.name,
                "model_path": key if key.startswith("tinker://") else None}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        req = await body(request, t.SampleRequest)
        if req.sampling_session_id is not None:
            key = service.sampling_sessions.get(req.sampling_session_id)
            if key is None:
                raise BadRequest(f"unknown sampling session {req.sampling_session_id}")
        else:
            key = service.sampling_source(base_model=req.base_model, model_path=req.model_path)
        prompt = [int(x) for chunk in req.prompt.chunks for x in _chunk_tokens(chunk)]
        p = req.sampling_params
        max_tokens = service.check_sample(prompt, req.num_samples, p.max_tokens)
        if req.target_prompt_logprobs is not None or req.prompt_alt_tokens_k:
            raise BadRequest("target_prompt_logprobs and prompt_alt_tokens_k are not supported")
        top_limit = service.loop.engine.config.max_top_logprobs
        if req.topk_sample_logprobs > top_limit:
            raise BadRequest(f"topk_sample_logprobs {req.topk_sample_logprobs} is more than the server's "
                             f"--max-top-logprobs {top_limit}")
        if req.topk_prompt_logprobs < 0 or req.topk_prompt_logprobs > 64:
            raise BadRequest(f"topk_prompt_logprobs must be in [0, 64], got {req.topk_prompt_logprobs}")
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise BadRequest(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n}")
        stop_ids, stop_strings = _stops(p.stop, service)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=p.temperature,
                                top_k=0 if p.top_k is None or p.top_k < 0 else p.top_k, top_p=p.top_p,
                                seed=_seed(p.seed), stop_token_ids=stop_ids)
        request_id, fut = service.futures.new()

        async def run():
            try:
                fut.set_result(await service.sample(
                    key, prompt, req.num_samples, params, stop_strings, prompt_logprobs=bool(req.prompt_logprobs),
                    topk_prompt=req.topk_prompt_logprobs, topk_sample=req.topk_sample_logprobs, last_n=last_n))
            except Exception as e:  # noqa: BLE001 - the future carries it
                log.exception("a sample request failed")
                fut.set_exception(e)

        asyncio.get_running_loop().create_task(run())
        return future(request_id, sample_sequence_ids=[f"{request_id}/{j}" for j in range(req.num_samples)])


def _chunk_tokens(chunk) -> list[int]:
    tokens = getattr(chunk, "tokens", None)
    if tokens is None:
        raise BadRequest("prompt holds an image or audio chunk; only text tokens are supported")
    return tokens


def _seed(seed: int | None) -> int:
    import secrets

    return secrets.randbits(31) if seed is None else int(seed) & 0x7FFFFFFF


def _stops(stop, service: TinkerService) -> tuple[tuple[int, ...] | None, list[str]]:
    """`(stop_token_ids, stop_strings)` of the SDK's `stop`: None keeps the model's
    end-of-sequence tokens; `[]` stops at nothing; token ids or strings otherwise."""
    if stop is None:
        return None, []
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    if not stop:
        return (), []
    ids = [s for s in stop if isinstance(s, int)]
    if len(ids) == len(stop):
        vocab = service.model_config.vocab_size
        bad = [s for s in ids if not 0 <= s < vocab]
        if bad:
            raise BadRequest(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return tuple(ids), []
    if all(isinstance(s, str) and s for s in stop):
        return None, stop
    raise BadRequest("stop must be strings (non-empty) or token ids, not a mix")
