"""Issue 40's RL-shaped sampling workload through the engine, against its own roofline.

`--prompts` random prompts of `--prompt` tokens (Qwen3-0.6B shape, random bf16
weights), each sampled `--n` times at temperature 1 (the samples share the prompt's
pages through the prefix cache). Each sample runs to a length drawn from a
log-normal (median `--median-new`, `--sigma`) clipped to [16, `--max-new`]: no stop
token, so every run does the same work with a long tail, as RL answers have. The
engine has `--max-seqs` slots and a pool of `--pool-gib` GiB; `Engine.warmup` compiles
first, and the run after it is timed (its wall clock; stepped one by one, less the
benchmark's page-by-page count between steps, while which the device idles).

The roofline is the run's own schedule at the data sheet's rates: every step that
decodes reads every weight once and the keys/values its rows hold (a shared prompt
page once: `tokens_held`) at `--bandwidth-gbs`; every prompt token computed (not found
in the prefix cache) costs its forward FLOPs at `--peak-tflops`. `of_roofline_read`
counts a shared page once per row (`tokens_read`: what the decode kernel reads today).

    python benchmarks/rl_workload.py --kv-dtypes bf16 int8
"""

import dataclasses
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from decode_batch_probe import modules_time, traced
from model_flops import decode_bytes_per_token, kv_element_bytes, prefill_flops

import eqx_tx
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.models.presets import preset


@dataclasses.dataclass(frozen=True)
class Args:
    preset: str = "qwen3-0.6b"
    prompts: int = 64
    n: int = 8
    prompt: int = 1024
    median_new: int = 1024
    sigma: float = 1.0
    """The log-normal's sigma: 1.0 puts ~1% of samples at 10x the median."""
    max_new: int = 8192
    max_seqs: int = 256
    page_size: int = 128
    pool_gib: float = 10.0
    """The page pool's size (keys, values and int8 scales of every layer)."""
    kv_dtypes: tuple[str, ...] = ("bf16",)
    """The pool's dtypes: `bf16` or `int8`."""
    mixed_steps: tuple[bool, ...] = (False,)
    """`EngineConfig.mixed_steps` settings to run (each with every pool dtype)."""
    shared_decode_rows: tuple[int | None, ...] = (None,)
    """`EngineConfig.shared_decode_rows` settings (0: off; 8: a Qwen3-0.6B prompt's 8
    samples read its pages once per decode step; `None`: the engine's default, 8 on a
    TPU for Qwen3-0.6B). Each run reports the setting in effect."""
    overlap_steps: tuple[bool, ...] = (True,)
    """`EngineConfig.overlap_steps` settings (each with every other setting)."""
    bandwidth_gbs: float = 819.0
    """TPU v5e data sheet."""
    peak_tflops: float = 197.0
    """TPU v5e data sheet, bf16."""
    seed: int = 0
    budget_s: float | None = None
    """Stop each run after this many seconds of its step loop (wall clock, the
    page-by-page `stats` between steps included; warmup not) and report the steps done
    so far (`"complete": false`; the roofline is those steps' own). A device call has
    a time limit that the 64-prompt workload can outlast."""
    profile_dir: str | None = None
    """After the timed loop (cut short by `--budget-s`), trace `--profile-steps` more
    steps with `jax.profiler` here and report their wall time against the time the
    device spent running programs (the rest: the host's planning, dispatch and
    bookkeeping between steps), and the device ops that took the most time."""
    profile_steps: int = 40


def workload(cfg, args: Args) -> list[tuple[list[int], SamplingParams, int]]:
    """`(prompt, params, sample)` of every sequence, prompt-major."""
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(args.median_new * np.exp(args.sigma * rng.standard_normal(args.prompts * args.n))),
                      16, args.max_new).astype(int)
    out = []
    for i in range(args.prompts):
        prompt = rng.integers(0, cfg.vocab_size, args.prompt).tolist()
        for j in range(args.n):
            params = SamplingParams(max_new_tokens=int(lengths[i * args.n + j]), temperature=1.0, seed=i,
                                    stop_token_ids=())
            out.append((prompt, params, j))
    return out


def run(model, cfg, kv: str, mixed: bool, share: int | None, overlap: bool, args: Args) -> dict:
    element = kv_element_bytes(cfg.head_dim, kv)
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element
    pool_tokens = int(args.pool_gib * 2**30 / token_bytes) // args.page_size * args.page_size
    engine = eqx_tx.Engine(model, max_seqs=args.max_seqs, page_size=args.page_size,
                           max_seq_len=args.prompt + args.max_new, max_tokens_in_cache=pool_tokens,
                           cache_dtype=jnp.int8 if kv == "int8" else None, mixed_steps=mixed,
                           shared_decode_rows=share, overlap_steps=overlap)
    t = time.perf_counter()
    engine.warmup()
    compile_s = time.perf_counter() - t
    # (a progress line: a run its device call cuts short still shows how far it got)
    setting = {"kv": kv, "mixed_steps": mixed, "shared_decode_rows": engine.share_rows, "overlap_steps": overlap}
    print(json.dumps({**setting, "warmup_s": round(compile_s, 1)}), flush=True)
    sequences = workload(cfg, args)
    for prompt, params, sample in sequences:
        engine.add(prompt, params, sample=sample)
    generated, steps, rows, held_s, read_s, stats_s = 0, 0, 0, 0.0, 0.0, 0.0
    started = time.perf_counter()
    while engine.has_work() and (args.budget_s is None or time.perf_counter() - started < args.budget_s):
        t = time.perf_counter()
        stats = engine.stats()  # counted page by page (not part of a step)
        stats_s += time.perf_counter() - t
        events = engine.step()  # host tokens (of the step before it, with overlap_steps)
        if events:
            steps += 1
            rows += len(events)
            held_s += decode_bytes_per_token(cfg, 2, kv_length=stats["tokens_held"], kv_bytes=element)
            read_s += decode_bytes_per_token(cfg, 2, kv_length=stats["tokens_read"], kv_bytes=element)
        generated += len(events)
    # Stepped one by one, the device idles while `stats` counts: its time is not the
    # engine's. Overlapped, the device runs the step in flight meanwhile, and the loop's
    # wall clock is the engine's time (the host, stats included, waits for the device).
    loop_s = time.perf_counter() - started
    seconds = loop_s if overlap else loop_s - stats_s
    profile = profile_steps(engine, args, "-".join(map(str, setting.values()))) \
        if args.profile_dir is not None and engine.has_work() else {}
    stats = engine.stats()
    computed = stats["prompt_tokens"] - stats["cached_tokens"]
    prefill_s = prefill_flops(cfg, computed / args.prompt, args.prompt) / (args.peak_tflops * 1e12)
    bandwidth = args.bandwidth_gbs * 1e9
    roofline_s, roofline_read_s = held_s / bandwidth + prefill_s, read_s / bandwidth + prefill_s
    complete = not engine.has_work()
    assert not complete or generated == sum(p.max_new_tokens for _, p, _ in sequences), generated
    del engine
    return {**setting, "sequences": len(sequences),
            "complete": complete, "generated": generated,
            "seconds": round(seconds, 1), "loop_s": round(loop_s, 1), "stats_s": round(stats_s, 1),
            "tokens_per_s": round(generated / seconds), "roofline_tokens_per_s": round(generated / roofline_s),
            "of_roofline": f"{roofline_s / seconds:.0%}", "of_roofline_read": f"{roofline_read_s / seconds:.0%}",
            "decode_steps": steps, "mean_rows": round(rows / max(steps, 1), 1),
            "prompt_tokens_computed": computed, "preemptions": stats["preemptions"],
            "pool_tokens": pool_tokens, "warmup_s": round(compile_s, 1), **profile}


def profile_steps(engine, args: Args, name: str) -> dict:
    """`--profile-steps` more engine steps under `jax.profiler`: their wall ms and the
    device's ms running programs in them."""
    out: dict = {}

    def run():
        t = time.perf_counter()
        out["profiled_rows"] = sum(len(engine.step()) for _ in range(args.profile_steps)) / args.profile_steps
        out["profiled_wall_ms"] = round(1e3 * (time.perf_counter() - t), 1)

    path, top = traced(os.path.join(args.profile_dir, name), run)
    if path is not None:
        out["profiled_device_ms"] = modules_time(path)
        out["profiled_top_ops_ms"] = top
    return {"profile": {"steps": args.profile_steps, **out}}


def main(args: Args) -> None:
    eqx_tx.enable_console_logging()
    cfg = preset(args.preset)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    print(json.dumps({"workload": dataclasses.asdict(args)}), flush=True)
    for kv in args.kv_dtypes:
        if kv not in ("bf16", "int8"):
            raise ValueError(f"--kv-dtypes: bf16 or int8, not {kv!r}")
    for kv, mixed, share, overlap in itertools.product(args.kv_dtypes, args.mixed_steps, args.shared_decode_rows,
                                                       args.overlap_steps):
        print(json.dumps(run(model, cfg, kv, mixed, share, overlap, args)), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
