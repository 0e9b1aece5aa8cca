"""Per-device memory of training and sampling, stage by stage, for a model on a TP mesh.

Stages are cumulative; each changes exactly one thing:

| stage | adds |
| --- | --- |
| 0 | baseline: XLA attention (materialised scores), full logits, no per-layer checkpointing, unchunked loss |
| 1 | flash attention (cuDNN on a GPU target, the blockwise kernel on CPU) |
| 2 | skip full logits: prefill applies the LM head to the last prompt token only (sampling; training unchanged) |
| 3 | per-layer checkpointing (`remat="full"`: only layer-boundary activations kept) |
| 4 | chunked LM head for the loss (training; sampling unchanged) |
| 5 | sequence parallelism: activations between blocks split over the sequence on `tp` (training) |
| 6 | chunked prefill, 512 positions at a time (sampling) |
| 7 | int8 KV cache with a float32 scale per token and kv head (sampling) |
| 8 | shared prompt KV for n=8 samples per prompt (sampling; batch = samples, prompts = batch / 8) |
| 9 | offload: each layer's saved input goes to pinned host memory in the forward pass and comes back for the backward (`remat="offload"`, training) |
| 10 | `remat="auto"`: the fastest policy that fits the budget, chosen per point (training) |

A stage that does not apply to the mode repeats the previous stage's figures.

`--measure compile` (default) lowers and compiles the real jitted `train_step` /
`prefill` + `decode` with abstract, sharded inputs and reads per-device memory from
`compiled.memory_analysis()` (arguments + outputs + temporaries - aliased; host memory
separately, with the bytes a step moves to and from it). No
weights, no accelerator: `--target a100-40gb` / `h100-80gb` compile for 8 compile-only
CUDA devices (bf16 stays bf16; needs the `bench` extra), `--target cpu` for 8 fake
CPU devices (bf16 buffers get f32 copies there: pessimistic by up to 2x).
`--measure run` executes on the local devices instead and reports peak memory and
time per step (a small `--model` on CPU; the real one on a GPU).

    python benchmarks/benchmark_memory.py --mode train --stage 4 --seq-lens 4096 --batch-sizes 1
"""

import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Literal

import tyro

if __name__ == "__main__":  # before JAX starts: compile-only GPU targets live on the CPU platform
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "--measure" not in sys.argv or "compile" in sys.argv[sys.argv.index("--measure") + 1 :][:1]:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from eqx_tx.core.compute import RematPolicy  # noqa: E402  (after the platform is chosen)

STAGES = {
    0: dict(attention="xla", skip_full_logits=False, remat="none", loss_chunk_size=0),
    1: dict(attention="flash", skip_full_logits=False, remat="none", loss_chunk_size=0),
    2: dict(attention="flash", skip_full_logits=True, remat="none", loss_chunk_size=0),
    3: dict(attention="flash", skip_full_logits=True, remat="full", loss_chunk_size=0),
    4: dict(attention="flash", skip_full_logits=True, remat="full", loss_chunk_size=8192),
    5: dict(attention="flash", skip_full_logits=True, remat="full", loss_chunk_size=8192, sequence_parallel=True),
    6: dict(attention="flash", skip_full_logits=True, remat="full", loss_chunk_size=8192, sequence_parallel=True,
            prefill_chunk_size=512),
    7: dict(attention="flash", skip_full_logits=True, remat="full", loss_chunk_size=8192, sequence_parallel=True,
            prefill_chunk_size=512, kv_cache_dtype="int8"),
    8: dict(attention="flash", skip_full_logits=True, remat="full", loss_chunk_size=8192, sequence_parallel=True,
            prefill_chunk_size=512, kv_cache_dtype="int8", n=8),
    9: dict(attention="flash", skip_full_logits=True, remat="offload", loss_chunk_size=8192, sequence_parallel=True,
            prefill_chunk_size=512, kv_cache_dtype="int8", n=8),
    10: dict(attention="flash", skip_full_logits=True, remat="auto", loss_chunk_size=8192, sequence_parallel=True,
             prefill_chunk_size=512, kv_cache_dtype="int8", n=8),
}
SETTINGS = ("attention", "skip_full_logits", "remat", "loss_chunk_size", "sequence_parallel", "prefill_chunk_size",
            "kv_cache_dtype", "n")
DEFAULTS = dict(sequence_parallel=False, prefill_chunk_size=None, kv_cache_dtype="bfloat16", n=1)


@dataclasses.dataclass
class Args:
    experiment_name: str = "qwen3-4b-tp8"
    mode: Literal["sample", "train", "engine"] = "train"
    """engine: `eqx_tx.Engine`'s prefill chunk and decode step, every slot running, over a
    page pool holding the same requests as `sample` (n > 1: prompt pages shared)."""
    batch_sizes: str = "1,2,4,8,16,32,64,128,256,512"
    """Comma-separated; each stage stops at its first batch size over budget."""
    seq_lens: str = "4096,8192"
    output_root: str = "benchmarks/results"
    model: str = "qwen3-4b"
    """A preset (qwen3-4b, llama3.2-1b, llama3.1-8b, qwen2.5-7b, qwen3-30b-a3b) or a local HF directory."""
    tp: int = 8
    sp: int = 1
    """Context-parallel size (ring attention over the sequence)."""
    ep: int = 1
    """Expert-parallel size (MoE models); the mesh is ep x sp x tp devices."""
    device_memory_gib: float = 40.0
    mem_fraction: float = 0.75
    """JAX's default allocator cap: the budget is device_memory_gib * mem_fraction."""
    stage: tuple[int, ...] = ()
    """Stages to run (0-10), e.g. `--stage 5 9 10`; default: all."""
    measure: Literal["compile", "run"] = "compile"
    target: Literal["a100-40gb", "h100-80gb", "cpu"] = "a100-40gb"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # Switches overriding the stage's settings:
    attention: Literal["xla", "flash", "cudnn", "blockwise"] | None = None
    skip_full_logits: bool | None = None
    remat: RematPolicy | None = None
    loss_chunk_size: int | None = None
    """Tokens per LM-head chunk; 0 = unchunked."""
    sequence_parallel: bool | None = None
    kv_cache_dtype: Literal["bfloat16", "float32", "int8"] | None = None
    n: int | None = None
    """Samples per prompt sharing the prompt's KV (sampling); batch sizes count samples."""
    full_finetune: bool = False
    """Train all weights instead of LoRA rank-32 adapters on every projection (frozen base;
    attention projections only for MoE models)."""
    offload_optimizer: bool = False
    """Keep the optimizer state in pinned host memory between steps (`TrainConfig.offload_optimizer`)."""
    lora_rank: int = 32
    lora_adapters: int | None = None
    """Train a bank of this many LoRA adapters (one per sequence) instead of one."""
    prefill_chunk_size: int | None = None
    """Prefill this many positions at a time (default: the stage's; whole prompt before stage 6)."""
    run_steps: int = 3
    """--measure run: timed steps after one warm-up step."""
    single: str | None = None
    """Internal: run one configuration (JSON) and print its result (used by --measure run)."""


def stage_settings(args: Args, stage: int) -> dict:
    s = dict(DEFAULTS, **STAGES[stage])
    for key in SETTINGS:
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if s["attention"] == "flash":
        s["attention"] = "blockwise" if args.target == "cpu" and args.measure == "compile" else "auto"
    return s


def _config(args: Args):
    import eqx_tx
    from eqx_tx.models.config import read_hf_config
    from eqx_tx.models.presets import PRESETS

    if args.model in PRESETS:
        return PRESETS[args.model]
    return eqx_tx.config_from_hf(read_hf_config(args.model))


def _compute(args: Args, settings):
    import eqx_tx

    return eqx_tx.ComputeConfig(
        attention=settings["attention"], remat=settings["remat"], sequence_parallel=settings["sequence_parallel"],
        memory_budget_gib=args.device_memory_gib * args.mem_fraction if args.measure == "compile" else None,
    )


def _train_config(args: Args, settings):
    from eqx_tx.train.training import TrainConfig

    chunk = settings["loss_chunk_size"] or None
    return TrainConfig(loss_chunk_size=chunk, compute=_compute(args, settings), offload_optimizer=args.offload_optimizer)


def measure_compile(args: Args, stage: int, seq_len: int, batch: int, mesh, model) -> dict:
    import jax
    import jax.numpy as jnp

    from eqx_tx.analysis.memory import (
        MemoryFigures,
        abstract_train_inputs,
        compile_engine_step,
        compile_sampling,
        compile_train_step,
    )
    from eqx_tx.core.hlo import format_summary, per_layer_summary
    from eqx_tx.infer.config import EngineConfig
    from eqx_tx.train.remat_auto import remat_label
    from eqx_tx.train.training import resolve_remat

    settings = stage_settings(args, stage)
    start = time.perf_counter()
    comms, remat = "", settings["remat"]
    if args.mode == "train":
        config = _train_config(args, settings)
        try:
            compiled = compile_train_step(model, mesh, batch, seq_len, config)
        except ValueError as e:  # remat="auto" with nothing that fits, or a compiler error
            return dict(bytes=None, phase="train_step", seconds=time.perf_counter() - start, error=str(e)[:2000])
        inputs = abstract_train_inputs(model, mesh, batch, seq_len, config)
        with jax.set_mesh(mesh):
            remat = remat_label(resolve_remat(*inputs, config).compute)  # (remembered: no second search)
        figures = {"train_step": MemoryFigures.of(compiled)}
        comms = format_summary(per_layer_summary(compiled.as_text(), model.config.num_hidden_layers))
    elif args.mode == "engine":
        if batch % settings["n"]:
            return dict(bytes=None, phase="-", seconds=0.0, skipped=True)
        # The same requests as --mode sample (prompt T/2, T/2 new tokens); the pool holds each
        # prompt once for its n samples (pages shared) plus every sample's own tokens.
        n, half = settings["n"], seq_len // 2
        pool = batch // n * half + batch * (seq_len - half) if n > 1 else batch * seq_len
        engine = EngineConfig(max_seqs=batch, max_tokens_in_cache=pool, max_seq_len=seq_len,
                              prefill_chunk=settings["prefill_chunk_size"] or 512,
                              kv_cache_dtype=settings["kv_cache_dtype"])
        compiled = compile_engine_step(model, mesh, engine, compute=_compute(args, settings))
        figures = {k: MemoryFigures.of(v) for k, v in compiled.items()}
    else:
        if batch % settings["n"]:
            return dict(bytes=None, phase="-", seconds=0.0, skipped=True)
        compiled = compile_sampling(
            model, mesh, batch, seq_len // 2, seq_len - seq_len // 2, compute=_compute(args, settings),
            cache_dtype=jnp.dtype(settings["kv_cache_dtype"]), prefill_chunk=settings["prefill_chunk_size"],
            full_logits=not settings["skip_full_logits"], n=settings["n"],
        )
        figures = {k: MemoryFigures.of(v) for k, v in compiled.items()}
    phase, peak = max(figures.items(), key=lambda kv: kv[1].total)
    return dict(bytes=peak.total, phase=phase, argument=peak.argument, output=peak.output, temp=peak.temp,
                alias=peak.alias, host_bytes=peak.host_total, host_moved=peak.host_moved, remat=remat,
                seconds=time.perf_counter() - start, collectives=comms)


def measure_run_single(args: Args, stage: int, seq_len: int, batch: int) -> dict:
    """Execute `run_steps` real steps here; peak device memory (GPU) or peak RSS (CPU)."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqx_tx
    from eqx_tx.infer.generation import generate
    from eqx_tx.infer.sampling import SamplingParams
    from eqx_tx.layers.lora import ALL_TARGETS, ATTENTION_TARGETS, apply_lora
    from eqx_tx.train.training import Batch, init_train_state, train_step

    settings = stage_settings(args, stage)
    config = _config(args)
    tp = min(args.tp, len(jax.devices()))
    sp = max(1, min(args.sp, len(jax.devices()) // tp))
    mesh = eqx_tx.make_mesh(dp=1, sp=sp, tp=tp, devices=jax.devices()[: sp * tp])
    dtype = jnp.dtype(args.dtype)
    model = eqx_tx.init_model(config, key=jax.random.key(0), dtype=dtype, mesh=mesh)
    rng = np.random.default_rng(0)
    times = []
    if args.mode == "train":
        if not args.full_finetune:
            targets = ATTENTION_TARGETS if config.num_experts else ALL_TARGETS
            model = apply_lora(model, rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=targets,
                               key=jax.random.key(1))
            model = eqx_tx.shard(model, mesh)
        tc = _train_config(args, settings)
        with jax.set_mesh(mesh):
            state = init_train_state(model, tc)
        del model
        for _ in range(args.run_steps + 1):
            ids = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq_len + 1)), jnp.int32)
            b = Batch(ids[:, :-1], ids[:, 1:], jnp.ones((batch, seq_len), jnp.float32), jnp.full((batch,), seq_len))
            t = time.perf_counter()
            state, metrics = train_step(state, b, tc)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
    else:
        prompts = rng.integers(0, config.vocab_size, (batch, seq_len // 2)).tolist()
        params = SamplingParams(max_new_tokens=seq_len - seq_len // 2, temperature=1.0, stop_token_ids=())
        n = settings["n"]
        for _ in range(args.run_steps + 1):
            t = time.perf_counter()
            generate(model, prompts[: max(1, batch // n)], params, n=n, prefill_chunk_size=settings["prefill_chunk_size"],
                     cache_dtype=settings["kv_cache_dtype"], compute=_compute(args, settings))
            times.append(time.perf_counter() - t)
    device = jax.devices()[0]
    if device.platform == "gpu":
        peak = max(d.memory_stats()["peak_bytes_in_use"] for d in jax.devices()[:tp])
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(bytes=peak, phase="run", seconds=float(np.mean(times[1:])), argument=0, output=0, temp=0, alias=0)


def measure_run(args: Args, stage: int, seq_len: int, batch: int) -> dict:
    """Each run configuration in a fresh process, so peak RSS belongs to it alone."""
    payload = json.dumps(dict(stage=stage, seq_len=seq_len, batch=batch))
    argv = [sys.executable, __file__, *sys.argv[1:], "--single", payload]
    result = subprocess.run(argv, capture_output=True, text=True)
    lines = [l for l in result.stdout.splitlines() if l.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return dict(bytes=None, phase="run", seconds=0.0, error=result.stderr.strip().splitlines()[-1:] or ["failed"])
    return json.loads(lines[-1][len("RESULT ") :])


def _tokens(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def write_outputs(args: Args, rows: list[dict], out_dir: str, budget: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    fields = ["experiment", "mode", "stage", "seq_len", "batch", "target", "tp", "measure", "phase", "bytes",
              "argument", "output", "temp", "alias", "host_bytes", "host_moved", "remat", "seconds", "fits",
              "collectives"]
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    unit = "compile s" if args.measure == "compile" else "s/step"
    lines = [f"# {args.experiment_name}: {args.mode}, {args.model}, ep={args.ep} x sp={args.sp} x tp={args.tp}, target {args.target}, "
             f"budget {args.device_memory_gib:g} GiB x {args.mem_fraction:g} = {budget / 2**30:.1f} GiB", "",
             f"Cells: peak MiB per device / {unit}; ERROR = over budget. With host memory (offload): "
             "+ host MiB, and the GiB a step moves between device and host. Stage 10: the policy "
             '`remat="auto"` chose.', ""]
    seq_lens = sorted({r["seq_len"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    for T in seq_lens:
        lines += [f"## seq_len {T}", "", "| stage | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---" * (len(batches) + 1) + "|"]
        for stage in sorted({r["stage"] for r in rows}):
            cells = []
            for b in batches:
                r = next((r for r in rows if r["stage"] == stage and r["seq_len"] == T and r["batch"] == b), None)
                if r is None:
                    cells.append("")
                elif not r["fits"]:
                    cells.append("ERROR" if r["bytes"] is None else f"ERROR ({r['bytes'] / 2**20:,.0f})")
                else:
                    seconds = "cached" if r["seconds"] < 0.05 else f"{r['seconds']:.1f}"
                    host = (f" + {r['host_bytes'] / 2**20:,.0f} host ({r['host_moved'] / 2**30:.1f} GiB moved)"
                            if r.get("host_bytes") else "")
                    chosen = f" `{r['remat']}`" if r["stage"] == 10 else ""
                    cells.append(f"{r['bytes'] / 2**20:,.0f}{host}{chosen} / {seconds}")
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Max batch size", "", "| stage | " + " | ".join(f"{args.mode} {_tokens(T)}" for T in seq_lens) + " |",
              "|---" * (len(seq_lens) + 1) + "|"]
    for stage in sorted({r["stage"] for r in rows}):
        best = [max([r["batch"] for r in rows if r["stage"] == stage and r["seq_len"] == T and r["fits"]], default=0)
                for T in seq_lens]
        lines.append(f"| {stage} | " + " | ".join(str(b) for b in best) + " |")
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')")
        return
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(6 * len(seq_lens), 4), squeeze=False)
    for ax, T in zip(axes[0], seq_lens):
        for stage in sorted({r["stage"] for r in rows}):
            pts = [(r["batch"], r["bytes"] / 2**30) for r in rows if r["stage"] == stage and r["seq_len"] == T and r["bytes"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"stage {stage}")
        ax.axhline(budget / 2**30, color="k", linestyle="--", label="budget")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="GiB per device", title=f"{args.mode}, T={T}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory.png"), dpi=100)


def main(args: Args) -> None:
    if args.single is not None:
        job = json.loads(args.single)
        print("RESULT " + json.dumps(measure_run_single(args, job["stage"], job["seq_len"], job["batch"])))
        return
    from tqdm.auto import tqdm

    from eqx_tx import enable_console_logging

    enable_console_logging()  # e.g. remat="auto": each candidate's FLOPs and memory, and the choice

    batches = sorted(int(b) for b in args.batch_sizes.split(","))
    seq_lens = sorted(int(t) for t in args.seq_lens.split(","))
    stages = sorted(args.stage) if args.stage else sorted(STAGES)
    if args.mode == "engine" and args.measure == "run":
        raise ValueError("--mode engine is measured by compiling (--measure compile)")
    for s in stages:
        if s not in STAGES:
            raise ValueError(f"--stage {s}: choose from {sorted(STAGES)}")
    budget = int(args.device_memory_gib * args.mem_fraction * 2**30)
    out_dir = os.path.join(args.output_root, args.experiment_name, args.mode)
    mesh = model = None
    if args.measure == "compile":
        import jax.numpy as jnp

        from eqx_tx.analysis.memory import abstract_sharded_model, target_mesh

        mesh = target_mesh(args.target, ep=args.ep, sp=args.sp, tp=args.tp)
        rank = 0 if (args.mode != "train" or args.full_finetune) else args.lora_rank
        model = abstract_sharded_model(_config(args), mesh, jnp.dtype(args.dtype), lora_rank=rank,
                                       lora_adapters=args.lora_adapters if rank else None)
    rows = []
    bar = tqdm(total=len(stages) * len(seq_lens) * len(batches), desc=f"{args.mode} memory")
    for stage in stages:
        for T in seq_lens:
            over = False
            for b in batches:
                bar.update()
                if over:
                    continue
                bar.set_postfix(stage=stage, T=T, B=b)
                if args.measure == "compile":
                    r = measure_compile(args, stage, T, b, mesh, model)
                else:
                    r = measure_run(args, stage, T, b)
                if r.get("skipped"):
                    continue
                fits = r["bytes"] is not None and r["bytes"] <= budget
                rows.append(dict(r, experiment=args.experiment_name, mode=args.mode, stage=stage, seq_len=T, batch=b,
                                 target=args.target, tp=args.tp, measure=args.measure, fits=fits))
                tqdm.write(f"stage {stage} T={T} B={b}: "
                           + (f"failed: {r.get('error', '?')}" if r["bytes"] is None else f"{r['bytes'] / 2**30:.2f} GiB ({r['phase']})")
                           + ("" if fits else "  over budget"))
                if r.get("collectives") and b == batches[0]:
                    tqdm.write(f"  collectives at B={b}: {r['collectives']}")
                over = not fits
    bar.close()
    write_outputs(args, rows, out_dir, budget)
    with open(os.path.join(out_dir, "command.txt"), "w") as f:
        f.write("python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
