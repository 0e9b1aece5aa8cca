"""Serve a model over an OpenAI-compatible HTTP API (needs the `serve` extra).

Requests share one continuous-batching engine (`eqx_tx.Engine`: paged KV cache,
prefix cache across requests). Any OpenAI client works:

    python tools/serve.py --model runs/tiny/final --port 8000
    python -c "from openai import OpenAI; c = OpenAI(base_url='http://localhost:8000/v1', api_key='-');
               print(c.completions.create(model='tiny', prompt='Once upon a time', max_tokens=32))"

`top_k` is an extra body field (`extra_body={"top_k": 20}`); `logprobs` gives each
sampled token's log-probability and up to `--max-top-logprobs` alternatives. Before
it listens, the server compiles every step shape the engine can run (a progress line
on stderr), so no request waits for a compile. `GET /health` and `GET /metrics`
(Prometheus) show that it runs and what it does. `--lora NAME=DIR` (repeatable)
also serves PEFT LoRA adapters of the model, each as model NAME; requests for the
base and for any adapter are batched together (one adapter bank, the base in a
slot of zeros).

The same process serves the **Tinker API** under `/api/v1` (unless `--no-tinker-api`):
the official `tinker` SDK and `tinker-cookbook` recipes run unchanged against it,

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_recipe.py

training LoRA runs on the slots of one adapter bank over the served model and sampling
through the same engine (see README, "Tinker API"). `--api-key` (or the environment
variable EQX_TX_API_KEY) makes both APIs refuse requests without it.
"""

import dataclasses
import os
import sys
import time
from typing import Annotated, Literal

import tyro

from eqx_tx.cli import run_tool
from eqx_tx.core.compute import AttentionImpl
from eqx_tx.infer.config import EngineConfig
from eqx_tx.serve.tinker_config import TinkerConfig


@dataclasses.dataclass
class Args:
    model: str = "runs/tiny/final"
    """An HF checkpoint directory or a hub repo id."""
    model_name: str | None = None
    """The name clients ask for (default: the checkpoint's name: a hub repo id as given; a
    directory's name, or its run's for a `tools/train.py` output like runs/NAME/final)."""
    host: str = "127.0.0.1"
    """The address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)."""
    port: int = 8000
    """The port to listen on."""
    engine: Annotated[EngineConfig, tyro.conf.OmitArgPrefixes] = EngineConfig(max_top_logprobs=5)
    """The continuous-batching engine: slots, page pool, prefill chunks."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype (auto: the checkpoint's)."""
    tp: int = 1
    """Tensor-parallel size."""
    attention: AttentionImpl = "auto"
    """The attention kernel (auto: chosen per shape and platform, logged; the engine's page pool is always
    read by the paged kernel)."""
    warmup: bool = True
    """Compile every step shape before listening (--no-warmup: compile on the first requests instead)."""
    lora: tuple[str, ...] = ()
    """NAME=DIRECTORY: serve this PEFT LoRA adapter (same targets, rank and alpha for all) as model NAME
    (the OpenAI API only: it turns the Tinker API off)."""
    tinker_api: bool = True
    """Serve the Tinker API under /api/v1 (training and sampling LoRA runs over the model)."""
    tinker: Annotated[TinkerConfig, tyro.conf.OmitArgPrefixes] = TinkerConfig()
    """The Tinker API: training slots, ranks, sampler slots, where checkpoints are kept."""
    api_key: str | None = None
    """Refuse requests (401) that do not carry this key (X-API-Key, or Authorization: Bearer); default: the
    environment variable EQX_TX_API_KEY if set, else no key."""


def build(args: Args):
    """The engine loop and the FastAPI app for `args` (the tests serve it themselves)."""
    import jax
    import jax.numpy as jnp

    import eqx_tx
    from eqx_tx.core.log import logger
    from eqx_tx.io.loading import resolve_source
    from eqx_tx.serve.loop import EngineLoop
    from eqx_tx.serve.openai import build_app

    directory = resolve_source(args.model)
    dtypes = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}
    mesh = eqx_tx.make_mesh(tp=args.tp) if args.tp > 1 else None
    model = eqx_tx.load(directory, dtype=dtypes[args.dtype], mesh=mesh, progress=False)
    name = args.model_name or served_name(args.model)
    adapters = None
    tinker = args.tinker_api and not args.lora
    if args.tinker_api and args.lora:
        logger.warning("--lora given: the Tinker API is off (its adapter bank is the engine's)")
    if tinker:
        from eqx_tx.serve.tinker_service import init_banks

        trainee, model = init_banks(model, args.tinker)
        adapters = {name: 0}
    if args.lora:
        names, paths = zip(*(_named_adapter(spec) for spec in args.lora))
        if len(set(names)) < len(names) or name in names:
            raise ValueError(f"--lora names {list(names)} repeat each other or the model's name {name!r}")
        model = eqx_tx.load_adapter_bank(model, paths, base_slot=True)
        adapters = {name: 0} | {n: i + 1 for i, n in enumerate(names)}
    engine = eqx_tx.Engine(model, args.engine, compute=eqx_tx.ComputeConfig(attention=args.attention))
    if args.warmup:
        started = time.perf_counter()

        def progress(done: int, total: int) -> None:
            print(f"\rwarming up: compiled {done}/{total} step shapes ({time.perf_counter() - started:.1f} s)",
                  end="" if done < total else "\n", file=sys.stderr, flush=True)

        engine.warmup(progress, scoring=tinker)  # the Tinker API scores prompts through the engine
    loop = EngineLoop(engine)
    tokenizer = eqx_tx.load_tokenizer(directory)
    app = build_app(loop, tokenizer, name, adapters)
    if tinker:
        from eqx_tx.core.util import has_pinned_host
        from eqx_tx.serve.tinker_api import add_tinker_routes
        from eqx_tx.serve.tinker_service import TinkerService
        from eqx_tx.train.bank_training import BankTrainer

        compute = eqx_tx.ComputeConfig(attention=args.attention)
        offload = args.tinker.offload_moments
        if offload is None:  # an accelerator with pinned host memory (on a CPU the device is the host)
            offload = jax.devices()[0].platform != "cpu" and has_pinned_host()
        trainer = BankTrainer(trainee, compute=compute, tokens_per_call=args.tinker.tokens_per_call,
                              offload_moments=offload)
        app.state.tinker = TinkerService(trainer, loop, name=name, tokenizer_id=os.path.abspath(directory),
                                         tokenizer=tokenizer, config=args.tinker, compute=compute)
        add_tinker_routes(app, app.state.tinker)
    key = args.api_key if args.api_key is not None else os.environ.get("EQX_TX_API_KEY")
    if key:
        from eqx_tx.serve.auth import require_api_key

        require_api_key(app, key)
    return loop, app


def served_name(model: str) -> str:
    """The name a checkpoint is served under: a hub repo id as given; a local
    directory's name, or for `tools/train.py`'s `runs/NAME/final` (or `checkpoint`),
    the run's name."""
    if not os.path.exists(model):
        return model  # a hub repo id
    path = os.path.normpath(os.path.abspath(model))
    name = os.path.basename(path)
    if name in ("final", "checkpoint", "adapter"):
        name = os.path.basename(os.path.dirname(path)) or name
    return name


def _named_adapter(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not (sep and name and path):
        raise ValueError(f"--lora {spec!r}: expected NAME=DIRECTORY")
    return name, path


def main(args: Args) -> None:
    import uvicorn

    import eqx_tx

    eqx_tx.enable_console_logging()
    loop, app = build(args)
    apis = "/v1: OpenAI API" + (", /api/v1: Tinker API" if hasattr(app.state, "tinker") else "")
    print(f"eqx_tx serving on http://{args.host}:{args.port} ({apis}, /health, /metrics)", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        if hasattr(app.state, "tinker"):
            app.state.tinker.stop()
        loop.stop()


if __name__ == "__main__":
    run_tool(main, Args)
