"""What the Tinker API costs over the library: training and sampling tokens/s, side by side.

Training, one `forward_backward` + `optim_step` of `--batch` datums of `--seq-len` tokens
(cross entropy, LoRA rank `--rank` on every projection), medians of `--repeats` steps after
a warm-up (compilation apart), in one process:

1. `train_step`: the library's jitted step on the same batch (one adapter, AdamW).
2. `BankTrainer`: the Tinker runs' training (a slot of the adapter bank: per-slot
   gradients, then PyTorch-style AdamW), called directly.
3. `service`: the Tinker service layer in-process, no sockets (so it runs on a TPU): the
   request encoded as the SDK encodes it (protobuf, zstd), parsed, run on the service's
   worker, its answer serialised: everything of the server but HTTP.
4. `SDK over HTTP` (`--http`, not on a TPU: no sockets there): the official `tinker` SDK
   against `tools/serve.py`'s app on 127.0.0.1.

Sampling (`--sample`): `--sample-batch` prompts of `--prompt-len` tokens, `--new-tokens`
each, through the `Engine` directly and through the SDK (`--http`): generated tokens/s.

    python benchmarks/tinker_api_speed.py --preset small --batch 4 --seq-len 1024 --http --sample
    python benchmarks/tinker_api_speed.py --preset qwen3-0.6b --batch 8 --seq-len 4096  # on a TPU
"""

import dataclasses
import importlib.util
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from timing import median_times

import eqx_tx
from eqx_tx.infer.config import EngineConfig
from eqx_tx.models import Qwen3Config
from eqx_tx.models.presets import preset
from eqx_tx.serve.loop import EngineLoop
from eqx_tx.serve.tinker_config import TinkerConfig
from eqx_tx.serve.tinker_service import TinkerService, init_banks
from eqx_tx.serve.tinker_wire import decompress, parse_forward_backward
from eqx_tx.train.bank_training import AdamWParams, BankTrainer, Datum

SMALL = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=32768)


@dataclasses.dataclass
class Args:
    preset: str = "small"
    """`small` (a 40M-parameter Qwen3 shape for CPU) or an `eqx_tx` preset (`qwen3-0.6b`, ...)."""
    batch: int = 4
    seq_len: int = 1024
    rank: int = 32
    repeats: int = 5
    dtype: str = "float32"
    """Parameter dtype: float32 (CPU) or bfloat16 (accelerators)."""
    http: bool = False
    """Also through the official SDK over HTTP on 127.0.0.1 (needs sockets: not on a TPU)."""
    sample: bool = False
    """Also sampling: the engine directly (and with --http the SDK)."""
    sample_batch: int = 16
    prompt_len: int = 128
    new_tokens: int = 64
    tokens_per_call: int = 16384
    skip_train_step: bool = False
    """Leave out `train_step` (e.g. a batch it cannot fit: the bank streams rows in calls of
    `tokens_per_call` tokens, so its batch is not bounded by memory)."""
    offload_moments: bool = False
    interleave: bool = False
    """Time the ways side by side, one call of each per round (`benchmarks/timing.py`):
    no order effects, but every model and state is alive at once (memory)."""


def _median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each callable's median seconds after two warm-up calls (the second takes the paths
    a second call takes, e.g. moments coming back from host memory), one after another."""
    out = {}
    for name, fn in fns.items():
        fn()
        out.update(median_times({name: fn}, repeats))
    return out


def _peak(after: str) -> None:
    """The device's peak bytes so far (accelerators report it)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"  peak device bytes after {after}: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB "
              f"of {stats.get('bytes_limit', 0) / 2**30:.2f}", flush=True)


def _tinker_datums(tokens: np.ndarray):
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(row[1:].astype(np.int64)),
                                        "weights": types.TensorData.from_numpy(np.ones(len(row) - 1, np.float32))})
            for row in tokens]


def _proto_body(model_id: str, datums) -> bytes:
    import zstandard
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=datums, loss_fn="cross_entropy"), model_id=model_id, seq_id=1)
    return zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(request).SerializeToString())


def main(args: Args) -> None:
    config = SMALL if args.preset == "small" else preset(args.preset)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    base = eqx_tx.init_model(config, key=jax.random.key(0), dtype=dtype)
    B, T = args.batch, args.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (B, T + 1)).astype(np.int32)
    trained_tokens = B * T
    print(f"{args.preset}: {sum(x.size for x in jax.tree.leaves(base)) / 1e6:.0f}M "
          f"parameters, {args.dtype}, LoRA rank {args.rank}; batch {B} x {T} tokens; {jax.default_backend()} "
          f"({jax.devices()[0].device_kind})")
    rows = []

    # 1. train_step
    lora = eqx_tx.apply_lora(base, rank=args.rank, alpha=32.0, key=jax.random.key(1))
    train_config = eqx_tx.TrainConfig(optimizer=eqx_tx.OptimizerConfig(learning_rate=1e-4, max_grad_norm=None))
    state = [eqx_tx.init_train_state(lora, train_config)]
    batch = eqx_tx.Batch(input_ids=jnp.asarray(tokens[:, :-1]), target_ids=jnp.asarray(tokens[:, 1:]),
                         loss_weights=jnp.ones((B, T), jnp.float32), lengths=jnp.full((B,), T, jnp.int32))

    def library_step():
        state[0], metrics = eqx_tx.train_step(state[0], batch, train_config)
        jax.block_until_ready(metrics["loss"])

    timings: dict[str, float] = {}
    steps: dict[str, Callable[[], object]] = {}  # timed together at the end with --interleave

    def measure(name: str, fn: Callable[[], object], peak: str | None = None) -> None:
        if args.interleave:
            steps[name] = fn
            return
        timings.update(_median_seconds({name: fn}, args.repeats))
        if peak:
            _peak(peak)

    if not args.skip_train_step:
        measure("train_step (the library)", library_step, "train_step")
    if not args.interleave:
        del state[0], lora

    # 2. BankTrainer, 3. the service
    tinker_config = TinkerConfig(max_adapters=2, max_lora_rank=args.rank, sampler_adapters=1,
                                 state_dir=tempfile.mkdtemp(), tokens_per_call=args.tokens_per_call)
    trainee, sampler_model = init_banks(base, tinker_config)
    trainer = BankTrainer(trainee, tokens_per_call=args.tokens_per_call, offload_moments=args.offload_moments)
    trainer.init_slot(0, rank=args.rank, seed=0)
    datums = [Datum(r[:-1], r[1:], np.ones(T, np.float32), np.zeros(T, np.float32), np.zeros(T, np.float32))
              for r in tokens]

    def bank_step():
        trainer.forward_backward(0, datums, "cross_entropy", {})
        trainer.adamw_step(0, AdamWParams())
        jax.block_until_ready(trainer.params)

    measure("BankTrainer (a slot of the bank)", bank_step, "BankTrainer")
    cache = args.sample_batch * 2 * (args.prompt_len + args.new_tokens)
    engine = eqx_tx.Engine(sampler_model, EngineConfig(max_seqs=max(args.sample_batch, 1), page_size=16,
                                                       max_tokens_in_cache=cache))
    loop = EngineLoop(engine)
    service = TinkerService(trainer, loop, name="bench", tokenizer_id="", tokenizer=None, config=tinker_config)
    service.create_model("bench:train:0", "bench", rank=args.rank, seed=0, train_attn=True, train_mlp=True,
                         train_unembed=False, user_metadata=None)
    body = _proto_body("bench:train:0", _tinker_datums(tokens))

    def service_step():
        request = parse_forward_backward(decompress(body, "zstd"))
        for fn in (lambda: service.forward_backward(request), lambda: service.optim_step("bench:train:0", {})):
            service.futures.get(service.on_worker(fn)).result()

    measure("service layer in-process (proto in and out, worker thread)", service_step, "service")
    if not args.interleave:
        measure("BankTrainer again (after the service: order effects)", bank_step)

    server = None
    if args.http:
        server, url, directory = _serve(base, args, tinker_config)
        import tinker

        client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = client.create_lora_training_client(base_model="bench", rank=args.rank, seed=0).result()
        sdk_datums = _tinker_datums(tokens)

        def sdk_step():
            fb = tc.forward_backward(sdk_datums, "cross_entropy")
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result()
            fb.result()

        measure("official SDK over HTTP (127.0.0.1)", sdk_step)
    if args.interleave:
        for fn in steps.values():
            fn()  # the second warm-up call (median_times makes the first)
        timings.update(median_times(steps, args.repeats))
        print(f"(interleaved: {args.repeats} rounds of one call of each)")
    rows = list(timings.items())

    print("\n| training: forward_backward + optim_step | s / step (median) | tokens/s | vs train_step |")
    print("|---|---|---|---|")
    for name, seconds in rows:
        ratio = f"{rows[0][1] / seconds:.2f}x" if not args.skip_train_step else "-"
        print(f"| {name} | {seconds:.3f} | {trained_tokens / seconds:,.0f} | {ratio} |")

    if args.sample:
        prompts = rng.integers(0, config.vocab_size, (args.sample_batch, args.prompt_len)).tolist()
        params = eqx_tx.SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=())
        samplers: dict[str, Callable[[], object]] = {}

        def engine_run():
            loop.call(lambda e: e.run([(p, params) for p in prompts], adapters=[0] * len(prompts)))

        samplers["Engine directly"] = engine_run
        if args.http:
            sampler = client.create_sampling_client(base_model="bench").result()
            sdk_params = tinker.types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[])

            def sdk_sample():
                futures = [sampler.sample(tinker.types.ModelInput.from_ints(p), 1, sdk_params) for p in prompts]
                for f in futures:
                    f.result()

            samplers["official SDK over HTTP"] = sdk_sample
        if args.interleave:
            for fn in samplers.values():
                fn()
            sample_rows = list(median_times(samplers, args.repeats).items())
        else:
            sample_rows = list(_median_seconds(samplers, args.repeats).items())
        generated = args.sample_batch * args.new_tokens
        print(f"\n| sampling: {args.sample_batch} prompts x {args.prompt_len} + {args.new_tokens} new | s (median) "
              "| generated tokens/s | vs engine |")
        print("|---|---|---|---|")
        for name, seconds in sample_rows:
            print(f"| {name} | {seconds:.3f} | {generated / seconds:,.0f} | {sample_rows[0][1] / seconds:.2f}x |")
    if server is not None:
        server.should_exit = True
    service.stop()
    loop.stop()


def _serve(base, args: Args, tinker_config: TinkerConfig):
    """`tools/serve.py`'s app on `base` (saved with the tiny tokenizer) on 127.0.0.1."""
    import uvicorn

    from eqx_tx.train.data import TINY_TOKENIZER

    directory = tempfile.mkdtemp()
    eqx_tx.save(base, directory, extra_files={"tokenizer.json": TINY_TOKENIZER})
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "serve.py")
    spec = importlib.util.spec_from_file_location("serve_tool", path)
    assert spec is not None and spec.loader is not None
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    engine = EngineConfig(max_seqs=max(args.sample_batch, 1), page_size=16,
                          max_tokens_in_cache=args.sample_batch * 2 * (args.prompt_len + args.new_tokens))
    _, app = serve.build(serve.Args(model=directory, model_name="bench", engine=engine, tinker=tinker_config,
                                    api_key="tml-bench", warmup=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    os.environ["TINKER_TELEMETRY"] = "0"
    return server, f"http://127.0.0.1:{port}", directory


if __name__ == "__main__":
    main(tyro.cli(Args))
