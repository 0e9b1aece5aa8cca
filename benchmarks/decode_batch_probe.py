"""Where a decode step's time goes as the batch grows (issue 40: the batch-64 collapse).

For each batch: `generate` of `--new` tokens after `--prompt`-token prompts, Qwen3-0.6B
shape, random bf16 weights; ms per decode step from two lengths (prefill and host
work cancel); the compiled decode loop's instruction census (copies and their bytes,
fusions, scatters, dynamic-update-slices); with `--profile-dir`, a `jax.profiler`
trace of one call per batch (Perfetto JSON copied next to it).

    python benchmarks/decode_batch_probe.py --batches 16 32 48 64 --out-dir /tmp/probe
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from model_flops import decode_bytes_per_token

import eqx_tx
from eqx_tx.infer import generation
from eqx_tx.infer.sampling import SamplerArrays, SamplingParams
from eqx_tx.models.presets import preset

_SHAPE = re.compile(r"\b(bf16|f32|s32|s8|pred|u32)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "s8": 1, "pred": 1, "u32": 4}


def census(hlo: str) -> dict:
    """Counts of the instructions that move memory, and the bytes the copies write."""
    ops = collections.Counter()
    copy_bytes = 0
    big_copies = collections.Counter()
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) (\w[\w-]*)\(", line)
        if not m:
            continue
        op = m.group(2)
        ops[op] += 1
        if op == "copy":
            shape = _SHAPE.search(m.group(1))
            if shape:
                n = int(np.prod([int(d) for d in shape.group(2).split(",") if d] or [1])) * _BYTES[shape.group(1)]
                copy_bytes += n
                if n >= 1 << 20:
                    big_copies[f"{shape.group(1)}[{shape.group(2)}]"] += 1
    keep = ("copy", "fusion", "scatter", "dynamic-update-slice", "dynamic-slice", "while", "custom-call", "dot",
            "convolution", "all-reduce")
    return {"ops": {k: ops[k] for k in keep if ops[k]}, "copy_MB": round(copy_bytes / 2**20, 1),
            "copies_over_1MB": dict(big_copies.most_common(8))}


def top_trace_ops(path: str, n: int = 15) -> list[tuple[str, float]]:
    """The device ops of a Perfetto trace that took the most time, in ms."""
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {p for p, name in pids.items() if "TPU" in name or "/device" in name}
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            total[e["name"]] += e.get("dur", 0) / 1e3
    return [(k, round(v, 2)) for k, v in total.most_common(n)]


def modules_time(path: str) -> float:
    """ms the device spent running programs in a Perfetto trace: its "XLA Modules"
    events (one per program run), summed (0.0 if the trace has none)."""
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["args"].get("name") == "XLA Modules"}
    return round(sum(e.get("dur", 0) for e in events
                     if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads) / 1e3, 2)


def traced(trace_dir: str, run: Callable[[], object], n: int = 15) -> tuple[str | None, list[tuple[str, float]]]:
    """`run()` under `jax.profiler` (a Perfetto trace written into `trace_dir`): the
    trace's path and its `n` device ops that took the most time (`None`, `[]`: no trace
    was written)."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        run()
    found = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    return (found[0], top_trace_ops(found[0], n)) if found else (None, [])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 48, 64])
    p.add_argument("--attentions", nargs="+", default=["auto"])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--out-dir", default="/tmp/probe")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    eqx_tx.enable_console_logging()
    cfg = preset("qwen3-0.6b")
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    rows = []
    for attention in args.attentions:
        compute = eqx_tx.ComputeConfig(attention=attention)  # type: ignore[arg-type]
        for b in args.batches:
            prompts = rng.integers(0, cfg.vocab_size, (b, args.prompt)).tolist()
            long = SamplingParams(max_new_tokens=args.new, stop_token_ids=())
            short = SamplingParams(max_new_tokens=args.new // 4, stop_token_ids=())
            times = {}
            for name, params in (("long", long), ("short", short)):
                eqx_tx.generate(model, prompts, params, compute=compute)  # compile
                samples = []
                for _ in range(3):
                    t = time.perf_counter()
                    eqx_tx.generate(model, prompts, params, compute=compute)
                    samples.append(time.perf_counter() - t)
                times[name] = float(np.median(samples))
            step_ms = 1e3 * (times["long"] - times["short"]) / (args.new - args.new // 4)
            # The compiled decode loop of this batch (the program that runs the steps).
            plan, seq_params, samples_ = generation.plan_requests(prompts, [long] * b, 1, True, None)
            state = generation.prefill_state(model, plan, None, compute)
            sampler = SamplerArrays.from_params(seq_params, cfg.eos_token_ids, cfg.vocab_size, samples_)
            hlo = generation.decode.lower(model, state, sampler, jnp.asarray(args.new, jnp.int32),
                                          compute=compute).compile().as_text()
            with open(os.path.join(args.out_dir, f"decode_b{b}_{attention}.hlo.txt"), "w") as f:
                f.write(hlo)
            # Bytes a step must read: every weight once, the keys/values cached so far
            # (the mean context over the steps timed), at the data sheet's 819 GB/s.
            context = args.prompt + (args.new // 4 + args.new) / 2
            roofline_ms = 1e3 * decode_bytes_per_token(cfg, 2, kv_length=b * context) / 819e9
            row = {"batch": b, "attention": attention, "step_ms": round(step_ms, 2),
                   "roofline_ms": round(roofline_ms, 2), "of_roofline": f"{roofline_ms / step_ms:.0%}", **census(hlo)}
            if args.profile:
                path, top = traced(os.path.join(args.out_dir, f"trace_b{b}_{attention}"),
                                   lambda: eqx_tx.generate(model, prompts, long, compute=compute))
                if path is not None:
                    shutil.copy(path, os.path.join(args.out_dir, f"perfetto_b{b}_{attention}.json.gz"))
                    row["top_device_ops_ms"] = top
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out_dir, "rows.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
