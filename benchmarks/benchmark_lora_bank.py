"""How a LoRA bank applies each row's adapter: per-row gather vs `lax.ragged_dot`.

One projection's adapter term `scaling * B[i] A[i] x` for every row of `x: [batch,
seq, in]`, forward + backward (gradients for `x` and the bank), medians of repeats,
side by side in one process; and the compiled temporary memory of each. Baseline: a
single adapter (every row the same), which is what a bank costs at least.

- `gather` (what `eqx_tx.layers.lora.LoRABank` does): `A[ids]: [batch, rank, in]`,
  then two batched matmuls per row.
- `ragged_dot`: rows sorted by adapter, tokens flattened, `lax.ragged_dot` over the
  groups, then unsorted.

    python benchmarks/benchmark_lora_bank.py --batch 8 --seq 512 --adapters 32
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro


@dataclasses.dataclass
class Args:
    batch: int = 8
    seq: int = 512
    dim_in: int = 1024
    dim_out: int = 1024
    rank: int = 32
    adapters: int = 32
    repeats: int = 7


def single(x, a, b, ids):
    del ids
    return jnp.einsum("btr,or->bto", jnp.einsum("bti,ri->btr", x, a[0]), b[0])


def gather(x, a, b, ids):
    return jnp.einsum("btr,bor->bto", jnp.einsum("bti,bri->btr", x, a[ids]), b[ids])


def ragged(x, a, b, ids):
    B, T, _ = x.shape
    order = jnp.argsort(ids)
    sizes = jnp.bincount(ids, length=a.shape[0]).astype(jnp.int32) * T
    xs = x[order].reshape(B * T, -1)
    h = jax.lax.ragged_dot(xs, jnp.swapaxes(a, 1, 2), sizes)
    d = jax.lax.ragged_dot(h, jnp.swapaxes(b, 1, 2), sizes).reshape(B, T, -1)
    return jnp.zeros_like(d).at[order].set(d)


def main(args: Args) -> None:
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (args.batch, args.seq, args.dim_in))
    a = 0.02 * jax.random.normal(k[1], (args.adapters, args.rank, args.dim_in))
    b = 0.02 * jax.random.normal(k[2], (args.adapters, args.dim_out, args.rank))
    ids = jax.random.randint(k[3], (args.batch,), 0, args.adapters)
    ref = gather(x, a, b, ids)
    print(f"batch {args.batch} x seq {args.seq}, {args.dim_in} -> {args.dim_out}, rank {args.rank}, "
          f"{args.adapters} adapters, platform {jax.default_backend()}")
    print("| method | fwd+bwd ms (median) | vs single adapter | temp MiB | max abs diff vs gather |")
    print("|---|---|---|---|---|")
    times = {}
    for name, fn in (("single adapter", single), ("gather", gather), ("ragged_dot", ragged)):
        def loss(x, a, b, fn=fn):
            return jnp.sum(fn(x, a, b, ids) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        temp = step.lower(x, a, b).compile().memory_analysis().temp_size_in_bytes / 2**20
        jax.block_until_ready(step(x, a, b))
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(x, a, b))
            samples.append(time.perf_counter() - t0)
        times[name] = float(np.median(samples))
        diff = "-" if name == "single adapter" else f"{float(jnp.max(jnp.abs(fn(x, a, b, ids) - ref))):.1e}"
        print(f"| {name} | {times[name] * 1e3:.2f} | {times[name] / times['single adapter']:.2f}x | {temp:,.1f} | {diff} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
