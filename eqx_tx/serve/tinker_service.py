"""The Tinker service: sessions, training runs on the slots of one adapter bank,
futures, checkpoints, and sampling through the engine.

Training runs live on the slots of a `BankTrainer` (one LoRA bank over the served
base model). Every training call (create, forward/backward, optimizer step, save,
load, unload) is queued to one worker thread and answered through a future, in the
order the SDK sends them; so the state of a run changes only by its own calls, and a
call that fails checks its input before it changes anything. Forward/backward passes
queued one after another (of one loss, from any clients) run as one batch of the bank. Sampling runs in the
engine (`EngineLoop`) beside it: the engine's model holds a second bank whose slot 0
is the base model and whose other slots hold the sampler weights in use (least
recently used ones are replaced). Futures are answered by `retrieve_future` (long
poll); request ids carry the server's instance, so a future from before a restart
fails with a clear error instead of waiting.
"""

import asyncio
import collections
import dataclasses
import json
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from ..core.compute import ComputeConfig
from ..core.fileio import atomic_directory
from ..core.log import logger
from ..infer.sampling import SamplingParams
from ..infer.steps import PromptScores
from ..io.adapters import load_adapter, save_adapter
from ..layers.lora import adapter_slot, without_adapters
from ..models import CausalLM
from ..train.bank_training import AdamWParams, BankTrainer, Datum
from ..train.objectives import INPUTS, objective_config
from . import tinker_wire as wire
from .loop import EngineFailure, EngineLoop
from .tinker_config import TinkerConfig
from .tinker_futures import Batchable, Futures, TrainingWorker
from .tinker_store import CheckpointStore, check_name, parse_path
from .tinker_wire import BadRequest


@dataclasses.dataclass
class Run:
    """A training run: its slot of the training bank and what it was created with."""

    model_id: str
    session_id: str
    slot: int
    rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    user_metadata: dict | None = None

    def info(self, base: str) -> dict:
        return dict(base_model=base, rank=self.rank, train_attn=self.train_attn, train_mlp=self.train_mlp,
                    train_unembed=self.train_unembed, session_id=self.session_id, user_metadata=self.user_metadata)


@dataclasses.dataclass
class _Slot:
    key: str | None = None
    users: int = 0
    ready: asyncio.Event | None = None
    used: float = 0.0


class TinkerService:
    """The Tinker API's state and operations (`eqx_tx.serve.tinker_api` routes HTTP to it).

    **Arguments:**

    - `trainer`: the training bank over the base model (`max_adapters` slots).
    - `loop`: the engine loop; its model holds a bank of `1 + sampler_adapters` slots
      (slot 0 all zeros: the base model) of the trainer's rank, alpha and targets.
    - `name`: the base model's served name; `tokenizer_id`: what the SDK's
      `get_tokenizer()` loads (the checkpoint directory).
    - `config`: the settings; `compute`: how prompt log-probs are computed.
    """

    def __init__(self, trainer: BankTrainer, loop: EngineLoop, *, name: str, tokenizer_id: str, tokenizer,
                 config: TinkerConfig, compute: ComputeConfig = ComputeConfig()):
        self.trainer, self.loop, self.name, self.tokenizer_id = trainer, loop, name, tokenizer_id
        self.tokenizer, self.config, self.compute = tokenizer, config, compute
        self.base: CausalLM = without_adapters(trainer.model)
        self.model_config = self.base.config
        self.store = CheckpointStore(config.state_dir)
        self.futures = Futures()
        self.worker = TrainingWorker(self.forward_backward_batch)
        self.sessions: dict[str, float] = {}
        self.runs: dict[str, Run] = {}
        self.free_slots = list(range(trainer.slots))
        self.sampling_sessions: dict[str, str] = {}  # id -> source key
        # source key -> plain adapter model in memory: a run's last `snapshots_per_run` ephemeral
        # snapshots, and up to `sampler_adapters` saved ones (reloaded from disk when dropped)
        self._snapshots: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._snapshots_lock = threading.Lock()
        self._slots = [_Slot() for _ in range(config.sampler_adapters)]  # engine slots 1..K
        self.max_seq_len = self.model_config.max_position_embeddings  # the longest datum that trains

    def stop(self) -> None:
        self.worker.stop()

    # -- futures ---------------------------------------------------------------------------

    def on_worker(self, fn: Callable[[], Any]) -> str:
        request_id, future = self.futures.new()
        self.worker.submit(fn, future)
        return request_id

    # -- sessions and models ---------------------------------------------------------------

    def create_session(self) -> str:
        session_id = str(uuid.uuid4())
        self.sessions[session_id] = time.time()
        return session_id

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise BadRequest(f"unknown session {session_id}")
        self.sessions[session_id] = time.time()

    def finish_session(self, session_id: str) -> None:
        """The session is over (`ServiceClient.close`): its runs are unloaded (on the worker)."""
        for model_id, run in list(self.runs.items()):
            if run.session_id == session_id:
                self.unload(model_id)
        self.sessions.pop(session_id, None)

    def check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.name:
            raise BadRequest(f"unknown base model {base_model!r}: this server serves {self.name!r}")

    def run(self, model_id: str) -> Run:
        run = self.runs.get(model_id)
        if run is None:
            raise BadRequest(f"unknown model_id {model_id!r} (not created on this server, or unloaded)")
        return run

    def create_model(self, model_id: str, session_id: str, *, rank: int, seed: int | None, train_attn: bool,
                     train_mlp: bool, train_unembed: bool, user_metadata: dict | None) -> dict:
        """A new run on a free slot (on the worker)."""
        if not 1 <= rank <= self.config.max_lora_rank:
            raise BadRequest(f"LoRA rank {rank} is outside [1, {self.config.max_lora_rank}] "
                             "(the server's --max-lora-rank)")
        if not (train_attn or train_mlp):
            raise BadRequest("train_attn and train_mlp are both off: this server trains LoRA on the attention and "
                             "MLP projections (not the unembedding alone)")
        if model_id in self.runs:
            raise BadRequest(f"model {model_id} exists already")
        if not self.free_slots:
            self._unload_abandoned()
        if not self.free_slots:
            raise BadRequest(f"all {self.trainer.slots} training slots are in use (the server's --max-adapters): "
                             "unload a model first")
        if train_unembed:
            logger.info("model %s: train_unembed is not supported (LoRA on the attention and MLP projections only)",
                        model_id)
        slot = self.free_slots.pop(0)
        self.trainer.init_slot(slot, rank=rank, train_attn=train_attn, train_mlp=train_mlp, seed=seed)
        run = Run(model_id, session_id, slot, rank, train_attn, train_mlp, train_unembed, user_metadata)
        self.runs[model_id] = run
        self.store.add_run(model_id, run.info(self.name))
        return {"model_id": model_id, "type": "create_model"}

    def _unload_abandoned(self) -> None:
        """Free the slots of runs whose session sent no heartbeat for `session_timeout_s`
        (their client is gone; their saved checkpoints stay)."""
        now = time.time()
        for model_id, run in list(self.runs.items()):
            if now - self.sessions.get(run.session_id, 0.0) > self.config.session_timeout_s:
                logger.warning("model %s: its session sent no heartbeat for %.0f s: unloaded", model_id,
                               now - self.sessions.get(run.session_id, 0.0))
                self.unload(model_id)

    def unload(self, model_id: str) -> dict:
        run = self.run(model_id)
        self.runs.pop(model_id)
        self.trainer.clear_gradients(run.slot)
        self.free_slots.append(run.slot)
        return {"model_id": model_id, "type": "unload_model"}

    def info(self, model_id: str) -> dict:
        run = self.run(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": run.rank,
                "model_name": self.name,
                "model_data": {"arch": type(self.model_config).__name__, "model_name": self.name,
                               "tokenizer_id": self.tokenizer_id}}

    # -- training --------------------------------------------------------------------------

    def _datums(self, request: wire.ForwardBackward) -> list[Datum]:
        if request.loss_fn not in INPUTS:
            objective_config(request.loss_fn, {})  # raises naming the supported ones
        required, optional = INPUTS[request.loss_fn]
        vocab = self.model_config.vocab_size
        if not request.datums:
            raise BadRequest("forward_backward needs at least one datum")
        out = []
        for i, (tokens, inputs) in enumerate(request.datums):
            n = len(tokens)
            if n == 0:
                raise BadRequest(f"data[{i}]: model_input is empty")
            if n > self.max_seq_len:
                raise BadRequest(f"data[{i}]: {n} tokens, more than the model's maximum {self.max_seq_len}")
            unknown = sorted(set(inputs) - set(required) - set(optional))
            if unknown:
                raise BadRequest(f"data[{i}]: loss_fn_inputs[{unknown[0]!r}] is not an input of {request.loss_fn!r} "
                                 f"(it takes {', '.join(required + optional)})")
            for name in required:
                if name not in inputs:
                    raise BadRequest(f"data[{i}]: {request.loss_fn!r} needs loss_fn_inputs[{name!r}]")
            for name, x in inputs.items():
                if x.shape != (n,):
                    raise BadRequest(f"data[{i}]: loss_fn_inputs[{name!r}] has shape {list(x.shape)}, but "
                                     f"model_input has {n} tokens: expected [{n}]")
            for name, ids in (("model_input", tokens), ("target_tokens", inputs["target_tokens"])):
                if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    bad = int(ids.max() if ids.max() >= vocab else ids.min())
                    raise BadRequest(f"data[{i}]: {name} holds token id {bad}, "
                                     f"outside the vocabulary [0, {vocab})")
            zeros = np.zeros(n, np.float32)
            out.append(Datum(tokens=tokens.astype(np.int32), targets=inputs["target_tokens"].astype(np.int32),
                             weights=inputs.get("weights", np.ones(n, np.float32)).astype(np.float32),
                             sampler_logprobs=inputs.get("logprobs", zeros).astype(np.float32),
                             advantages=inputs.get("advantages", zeros).astype(np.float32),
                             ratio_mask=None if "sequence_ratio_mask" not in inputs else
                             inputs["sequence_ratio_mask"].astype(np.float32)))
            for name in ("weights", "logprobs", "advantages", "sequence_ratio_mask"):
                if name in inputs and not np.all(np.isfinite(inputs[name])):
                    raise BadRequest(f"data[{i}]: loss_fn_inputs[{name!r}] holds a non-finite value")
        return out

    def submit_forward_backward(self, request: wire.ForwardBackward) -> str:
        """Queue a forward/backward pass; consecutive ones of one loss (and config, and
        direction) run as one batch, whichever clients sent them."""
        request_id, future = self.futures.new()
        key = (request.loss_fn, tuple(sorted(request.loss_fn_config.items())), request.forward_only)
        self.worker.submit(Batchable(key, request, future))
        return request_id

    def forward_backward(self, request: wire.ForwardBackward) -> bytes:
        """Score (and with a backward pass, accumulate gradients of) the request's datums."""
        [result] = self.forward_backward_batch([request])
        if isinstance(result, BaseException):
            raise result
        return result

    def forward_backward_batch(self, requests: list[wire.ForwardBackward]) -> list:
        """`forward_backward` of requests of one loss in one batch of the bank: each
        request's answer, or its own `BadRequest` (a bad request fails alone)."""
        answers: list = [None] * len(requests)
        slots, datums, owners = [], [], []
        for i, request in enumerate(requests):
            try:
                run = self.run(request.model_id)
                config = objective_config(request.loss_fn, request.loss_fn_config)
                mine = self._datums(request)
            except BadRequest as e:
                answers[i] = e
                continue
            slots += [run.slot] * len(mine)
            datums += mine
            owners += [i] * len(mine)
        if datums:
            first = requests[owners[0]]
            config = objective_config(first.loss_fn, first.loss_fn_config)
            logprobs, losses = self.trainer.forward_backward(slots, datums, first.loss_fn, config,
                                                             backward=not first.forward_only)
            for i in sorted(set(owners)):
                mine = [k for k, owner in enumerate(owners) if owner == i]
                answers[i] = wire.forward_backward_output(
                    {"logprobs": [logprobs[k] for k in mine], "elementwise_loss": [losses[k] for k in mine]},
                    {"loss:sum": float(sum(np.sum(losses[k], dtype=np.float64) for k in mine))})
        return answers

    def optim_step(self, model_id: str, params: dict) -> dict:
        run = self.run(model_id)
        try:
            hp = AdamWParams(**{k: float(params[k]) for k in dataclasses.asdict(AdamWParams()) if k in params})
        except ValueError as e:
            raise BadRequest(str(e)) from None
        norm = self.trainer.adamw_step(run.slot, hp)
        return {"metrics": {"grad_norm:mean": norm, "step:max": float(self.trainer.counts[run.slot])}}

    # -- weights ---------------------------------------------------------------------------

    def save_state(self, model_id: str, name: str | None, user_metadata: dict | None) -> dict:
        run = self.run(model_id)
        name = check_name(name) if name else f"step-{self.trainer.counts[run.slot]:06d}-{secrets.token_hex(2)}"
        state = self.trainer.slot_state(run.slot)
        tensors = {f"{part}/{leaf}": np.ascontiguousarray(x) for part, leaves in state.items()
                   for leaf, x in leaves.items()}
        meta = run.info(self.name) | {"step": self.trainer.counts[run.slot], "max_lora_rank": self.trainer.rank,
                                      "lora_alpha": self.config.lora_alpha}
        with atomic_directory(self.store.directory(model_id, "weights", name)) as tmp:
            save_file(tensors, os.path.join(tmp, "state.safetensors"))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
        self.store.add(model_id, "weights", name, {"user_metadata": user_metadata, "step": meta["step"]})
        return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

    def load_state(self, model_id: str, path: str, optimizer: bool, *, create: dict | None = None) -> dict:
        """Load the training state at `path` into the run `model_id` (created first from
        `create`'s session id when given); with `optimizer`, its AdamW moments and step too."""
        entry = self.store.get(path)
        if entry["kind"] != "weights":
            raise BadRequest(f"{path} is a sampler checkpoint; load_state needs a training state "
                             "(tinker://RUN/weights/NAME, from save_state)")
        with open(os.path.join(entry["directory"], "meta.json")) as f:
            meta = json.load(f)
        if meta["base_model"] != self.name or meta["max_lora_rank"] != self.trainer.rank:
            raise BadRequest(f"{path} was trained on {meta['base_model']!r} with max rank {meta['max_lora_rank']}; "
                             f"this server serves {self.name!r} with --max-lora-rank {self.trainer.rank}")
        flat = load_file(os.path.join(entry["directory"], "state.safetensors"))
        state: dict[str, dict] = {"params": {}, "m": {}, "v": {}}
        for key, value in flat.items():
            part, leaf = key.split("/", 1)
            state[part][leaf] = value
        if not optimizer:
            state = {"params": state["params"]}
        if create is not None:
            self.create_model(model_id, create["session_id"], rank=meta["rank"], seed=0,
                              train_attn=meta["train_attn"], train_mlp=meta["train_mlp"],
                              train_unembed=meta["train_unembed"], user_metadata=create.get("user_metadata"))
        run = self.run(model_id)
        if run.rank != meta["rank"]:
            raise BadRequest(f"{path} holds a rank-{meta['rank']} adapter; model {model_id} has rank {run.rank}")
        self.trainer.set_slot(run.slot, state, count=meta["step"] if optimizer else 0)
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    def save_for_sampler(self, model_id: str, name: str | None) -> dict:
        """Snapshot the run's adapter for sampling: under `name` as a PEFT checkpoint,
        or (no name) as an ephemeral sampling session. Returns the response."""
        run = self.run(model_id)
        adapter = adapter_slot(self.trainer.model, run.slot)
        if name is None:
            key = f"ephemeral:{model_id}:{uuid.uuid4()}"
            self._remember(key, adapter)
            session_id = str(uuid.uuid4())
            self.sampling_sessions[session_id] = key
            return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}
        check_name(name)
        save_adapter(adapter, self.store.directory(model_id, "sampler_weights", name),
                     base_model_name_or_path=self.tokenizer_id)
        path = f"tinker://{model_id}/sampler_weights/{name}"
        self.store.add(model_id, "sampler_weights", name, {"step": self.trainer.counts[run.slot]})
        self._remember(path, adapter)
        return {"path": path, "type": "save_weights_for_sampler"}

    def _remember(self, key: str, adapter) -> None:
        """Keep `adapter` for sampling as `key`; drop what is no longer needed in memory:
        a run's ephemeral snapshots but its last `snapshots_per_run` (an RL loop makes one per
        step), and saved ones past `sampler_adapters` (they reload from disk)."""
        with self._snapshots_lock:
            self._snapshots[key] = adapter
            self._snapshots.move_to_end(key)
            ephemeral = key.startswith("ephemeral:")
            prefix = key.rsplit(":", 1)[0] + ":" if ephemeral else "tinker://"
            same = [k for k in self._snapshots if k.startswith(prefix)]
            keep = self.config.snapshots_per_run if ephemeral else self.config.sampler_adapters
            for old in same[:max(0, len(same) - keep)]:
                del self._snapshots[old]

    # -- sampling --------------------------------------------------------------------------

    def sampling_source(self, *, base_model: str | None, model_path: str | None) -> str:
        """The key of what a sampling client samples: `base` or a sampler checkpoint path."""
        if model_path:
            run, kind, _ = parse_path(model_path)
            entry = self.store.get(model_path)
            if entry["kind"] != "sampler_weights":
                raise BadRequest(f"{model_path} is a training state; sample from a sampler checkpoint "
                                 "(tinker://RUN/sampler_weights/NAME, from save_weights_for_sampler)")
            return model_path
        self.check_base(base_model)
        if base_model is None:
            raise BadRequest("a sampling client needs base_model or model_path")
        return "base"

    def create_sampling_session(self, *, base_model: str | None, model_path: str | None) -> str:
        key = self.sampling_source(base_model=base_model, model_path=model_path)
        session_id = str(uuid.uuid4())
        self.sampling_sessions[session_id] = key
        return session_id

    def _adapter_model(self, key: str):
        with self._snapshots_lock:
            adapter = self._snapshots.get(key)
        if adapter is not None:
            return adapter
        if key.startswith("ephemeral:"):
            raise BadRequest("this sampling client's weights were dropped: the server keeps the last "
                             f"{self.config.snapshots_per_run} of save_weights_and_get_sampling_client per training "
                             "run (--snapshots-per-run); make a new sampling client")
        adapter = load_adapter(self.base, self.store.get(key)["directory"])
        self._remember(key, adapter)
        return adapter

    async def _acquire(self, key: str) -> int:
        """The engine slot holding `key`'s weights (loaded now if needed), held until `_release`."""
        if key == "base":
            return 0
        while True:
            for i, s in enumerate(self._slots):
                if s.key == key:
                    s.users += 1
                    s.used = time.monotonic()
                    assert s.ready is not None
                    await s.ready.wait()
                    return i + 1
            idle = [i for i, s in enumerate(self._slots) if s.users == 0]
            if idle:
                break
            await asyncio.sleep(0.05)  # every sampler slot is busy: wait for one
        i = min(idle, key=lambda j: self._slots[j].used)
        slot = self._slots[i]
        slot.key, slot.users, slot.used, slot.ready = key, 1, time.monotonic(), asyncio.Event()
        try:
            adapter = await asyncio.to_thread(self._adapter_model, key)
            await asyncio.to_thread(self.loop.call, lambda engine: engine.set_adapter(i + 1, adapter))
        except BaseException:
            slot.key, slot.users = None, 0
            slot.ready.set()
            raise
        slot.ready.set()
        return i + 1

    def _release(self, engine_slot: int) -> None:
        if engine_slot:
            self._slots[engine_slot - 1].users -= 1

    def check_sample(self, prompt: list[int], num_samples: int, max_tokens: int | None) -> int:
        vocab = self.model_config.vocab_size
        if not prompt:
            raise BadRequest("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt holds token id {bad[0]}, outside the vocabulary [0, {vocab})")
        if not 1 <= num_samples <= 1024:
            raise BadRequest(f"num_samples must be in [1, 1024], got {num_samples}")
        limit = self.loop.engine.max_seq_len
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        if max_tokens < 0 or len(prompt) + max_tokens > limit:
            raise BadRequest(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} is more than the server's "
                             f"maximum sequence length {limit}")
        return max_tokens

    async def sample(self, key: str, prompt: list[int], num_samples: int, params: SamplingParams,
                     stop_strings: list[str], *, prompt_logprobs: bool, topk_prompt: int, topk_sample: int,
                     last_n: int | None) -> bytes:
        """Sample `num_samples` continuations of `prompt` with `key`'s weights."""
        engine_slot = await self._acquire(key)
        # The first sample's prefill scores the prompt (the prefix before the scored
        # tokens from the prefix cache); the other samples share its pages.
        score = None
        if (prompt_logprobs or topk_prompt) and len(prompt) >= 2:
            score = (len(prompt) - 1 if last_n is None else last_n, topk_prompt)
        scores: list[PromptScores] = []
        try:
            jobs = [asyncio.create_task(self._one_sample(prompt, params, j, engine_slot, stop_strings,
                                                         score if j == 0 else None, scores))
                    for j in range(num_samples)]
            sequences = await asyncio.gather(*jobs)
        finally:
            self._release(engine_slot)
        logprobs = top_rows = None
        if prompt_logprobs or topk_prompt:
            # (none for a one-token prompt: nothing was scored)
            scored = scores[0].logprobs if scores else np.zeros(0, np.float32)
            alternatives = list(zip(scores[0].top_ids, scores[0].top_logprobs)) if scores else []
            n = len(scored)
            logprobs = np.full(len(prompt), np.nan, np.float32)
            logprobs[len(prompt) - n:] = scored
            if topk_prompt:
                top_rows = [None] * (len(prompt) - n) + [tuple(zip(ids.tolist(), lps.tolist()))
                                                         for ids, lps in alternatives]
            if not prompt_logprobs:
                logprobs = None
        return wire.sample_response(list(sequences), topk_sample=topk_sample, prompt_logprobs=logprobs,
                                    topk_prompt=top_rows, topk_prompt_k=topk_prompt)

    async def _one_sample(self, prompt: list[int], params: SamplingParams, sample: int, engine_slot: int,
                          stop_strings: list[str], score: tuple[int, int] | None = None,
                          scores: list[PromptScores] | None = None) -> wire.Sequence:
        """One sample through the engine; with `score`, its prompt's scores (which come
        with its first token) are appended to `scores`."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        aio = asyncio.get_running_loop()
        seq = wire.Sequence([], [], "length", [])
        longest = max(map(len, stop_strings), default=0)
        request_id: list[int] = []

        def finish(reason: str | BaseException) -> None:
            if not done.done():
                done.set_exception(reason) if isinstance(reason, BaseException) else done.set_result(reason)

        def listener(event) -> None:  # on the engine thread
            if isinstance(event, EngineFailure):
                aio.call_soon_threadsafe(finish, RuntimeError(f"the engine failed: {event.message}"))
                return
            if done.done():
                return
            if event.prompt_scores is not None and scores is not None:
                scores.append(event.prompt_scores)
            seq.tokens.append(event.token)
            seq.logprobs.append(event.logprob)
            assert seq.top is not None
            seq.top.append(event.top_logprobs)
            if stop_strings:
                tail = self.tokenizer.decode(seq.tokens[-(longest + 8):], skip_special_tokens=False)
                if any(s in tail for s in stop_strings):
                    seq.stop_reason = "stop"
                    if request_id:
                        self.loop.cancel(request_id[0])
                    aio.call_soon_threadsafe(finish, "stop")
                    return
            if event.finish_reason is not None:
                seq.stop_reason = event.finish_reason
                aio.call_soon_threadsafe(finish, event.finish_reason)

        future = self.loop.submit(prompt, params, sample, listener, adapter=engine_slot, score=score)
        request_id.append(await asyncio.wrap_future(future))
        await done
        if seq.stop_reason == "stop" and stop_strings:
            self.loop.cancel(request_id[0])  # a stop string ended it (before its id was known, perhaps)
        return seq


def init_banks(base: CausalLM, config: TinkerConfig):
    """The training bank model (`max_adapters` slots) and the engine's (`1 +
    sampler_adapters` slots) over `base`. Every slot starts with `B = 0`: the base model."""
    from ..layers.lora import ALL_TARGETS, ATTENTION_TARGETS, apply_lora

    def bank(n: int, key: int):
        try:
            return apply_lora(base, rank=config.max_lora_rank, alpha=config.lora_alpha, targets=ALL_TARGETS,
                              adapters=n, key=jax.random.key(key))
        except ValueError:  # a mixture of experts: adapters on the attention projections
            return apply_lora(base, rank=config.max_lora_rank, alpha=config.lora_alpha, targets=ATTENTION_TARGETS,
                              adapters=n, key=jax.random.key(key))

    return bank(config.max_adapters, 0), bank(1 + config.sampler_adapters, 1)
