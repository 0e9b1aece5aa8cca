"""One engine step's passes timed alone: a prefill chunk, a decode step, and both in
one mixed pass (`EngineConfig.mixed_steps`), at fixed shapes, on whatever backend
JAX has.

`--prefill-rows` contexts of `--context` tokens each get a `--chunk`-token chunk;
`--live` of the decode rows hold `--context`-token sequences, the others are
padding (as the scheduler pads: `--decode-rows` bucketed rows separately, `max_seqs`
rows in a mixed pass). Random weights; every pass's writes land in distinct pages.
Reported: the median ms of each pass over `--repeats` (after a compiling call, each
waiting for the pool), separate passes' sum against the mixed pass (at the decode
bucket and at `max_seqs` rows), and the ratio.

    python benchmarks/engine_step_time.py
    python benchmarks/engine_step_time.py --preset qwen3-0.6b --dtype bfloat16 --max-seqs 256 --decode-rows 256 \\
        --live 200 --context 1024   # on an accelerator
"""

import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from decode_batch_probe import traced

import eqx_tx
from eqx_tx.infer.scheduler import DecodeBatch, PrefillBatch
from eqx_tx.models.presets import preset


@dataclasses.dataclass(frozen=True)
class Args:
    preset: str = "tiny"
    dtype: str = "float32"
    max_seqs: int = 128
    decode_rows: int = 64
    """The decode bucket a separate decode pass runs (a power of two, at most `max_seqs`)."""
    live: int = 50
    """Decode rows holding a sequence (the rest: padding)."""
    prefill_rows: int = 4
    chunk: int = 256
    context: int = 300
    """Tokens before the prefill chunk, and each live decode row's length."""
    page_size: int = 16
    repeats: int = 5
    profile_dir: str | None = None
    """Also trace one prefill chunk and one decode pass (at the bucket) with
    `jax.profiler` here, and report each one's device ops that took the most time
    (on an accelerator: the cache writes against attention and the matmuls)."""


def main(args: Args) -> None:
    model = eqx_tx.init_model(preset(args.preset), key=jax.random.key(0), dtype=jnp.dtype(args.dtype))
    rows_total = args.prefill_rows + args.live  # padding rows hold no pages
    per_row = -(-(args.context + args.chunk + 1) // args.page_size)
    pool = rows_total * per_row * args.page_size
    engine = eqx_tx.Engine(model, max_seqs=args.max_seqs, page_size=args.page_size,
                           max_seq_len=per_row * args.page_size, max_tokens_in_cache=pool)
    runner, unallocated = engine.runner, engine.num_pages
    rng = np.random.default_rng(0)

    def table(first_row: int, n: int) -> np.ndarray:
        t = np.full((n, runner.pages_per_seq), unallocated, np.int32)
        for i in range(n):
            t[i, :per_row] = np.arange(per_row) + (first_row + i) * per_row
        return t

    prefill = PrefillBatch(np.full((args.prefill_rows,), args.max_seqs, np.int32), table(0, args.prefill_rows),
                           rng.integers(0, model.config.vocab_size, (args.prefill_rows, args.chunk)).astype(np.int32),
                           np.full((args.prefill_rows,), args.context, np.int32),
                           np.full((args.prefill_rows,), args.context + args.chunk, np.int32), None)

    def decode(R: int) -> DecodeBatch:
        live = np.arange(R) < args.live
        t = table(args.prefill_rows, R)
        t[~live] = unallocated
        rows = np.where(live, np.arange(R), args.max_seqs).astype(np.int32)
        return DecodeBatch((), rows, t, np.where(live, args.context, 0).astype(np.int32), np.zeros((R,), np.int32),
                           None)

    def median_ms(run) -> float:
        run()
        jax.block_until_ready(runner.cache)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            jax.block_until_ready(runner.cache)  # a prefill returns before its pass ends
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    small, full = decode(args.decode_rows), decode(args.max_seqs)
    row = {"preset": args.preset, "dtype": args.dtype, "backend": jax.default_backend(),
           "prefill": f"{args.prefill_rows}x{args.chunk}", "decode_rows": args.decode_rows, "live": args.live,
           "max_seqs": args.max_seqs, "context": args.context}
    row["prefill_ms"] = round(median_ms(lambda: runner.prefill(prefill)), 2)
    row["decode_ms"] = round(median_ms(lambda: runner.decode(small)), 2)
    row["separate_ms"] = round(row["prefill_ms"] + row["decode_ms"], 2)
    row["mixed_at_bucket_ms"] = round(median_ms(lambda: runner.mixed(prefill, small)), 2)
    row["mixed_at_max_seqs_ms"] = round(median_ms(lambda: runner.mixed(prefill, full)), 2)
    row["separate_over_mixed"] = round(row["separate_ms"] / row["mixed_at_max_seqs_ms"], 2)
    print(json.dumps(row), flush=True)
    if args.profile_dir is not None:
        for name, run in (("prefill", lambda: runner.prefill(prefill)), ("decode", lambda: runner.decode(small))):
            _, top = traced(os.path.join(args.profile_dir, name),
                            lambda run=run: (run(), jax.block_until_ready(runner.cache)), 20)
            print(json.dumps({"pass": name, "top_device_ops_ms": top}), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
