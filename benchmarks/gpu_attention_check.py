"""On a GPU: does the cuDNN path equal the blockwise kernel, and what do they cost at T=32k?

Runs causal attention forward+backward (bf16, GQA) with `implementation="cudnn"` and
`"blockwise"`, checks outputs and gradients agree within a bf16 tolerance, and reports
peak device memory and time for each. Exits with a message on a machine without a GPU.

    python benchmarks/gpu_attention_check.py --seq-len 32768
"""

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import tyro

from eqx_tx.kernels.dispatch import dot_product_attention


@dataclasses.dataclass
class Args:
    seq_len: int = 32768
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    repeats: int = 3


def run(impl: str, q, k, v):
    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, implementation=impl).astype(jnp.float32))

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out = jax.block_until_ready(f(q, k, v))  # compile + run
    device = jax.devices()[0]
    times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(f(q, k, v))
        times.append(time.perf_counter() - t)
    o = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, implementation=impl))(q, k, v)
    peak = device.memory_stats().get("peak_bytes_in_use", 0)
    return o, out[1], min(times), peak


def main(args: Args) -> None:
    if jax.default_backend() != "gpu":
        print(f"no GPU here (JAX backend: {jax.default_backend()}); this check needs one", file=sys.stderr)
        sys.exit(2)
    keys = jax.random.split(jax.random.key(0), 3)
    shape_q = (args.batch, args.seq_len, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq_len, args.kv_heads, args.head_dim)
    q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
    k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)
    results = {}
    for impl in ("cudnn", "blockwise"):
        results[impl] = run(impl, q, k, v)  # peak memory accumulates: cudnn first, it is the smaller
        o, grads, seconds, peak = results[impl]
        print(f"{impl:9s} fwd+bwd {seconds * 1e3:8.1f} ms   peak device memory so far {peak / 2**30:6.2f} GiB")
    (o1, g1, *_), (o2, g2, *_) = results["cudnn"], results["blockwise"]
    err = float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32))))
    gerr = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(g1, g2)]
    print(f"max |cudnn - blockwise|: output {err:.3e}, dq/dk/dv {gerr}")
    ok = err < 2e-2 and all(e < 0.25 * max(1.0, float(jnp.max(jnp.abs(b.astype(jnp.float32))))) for e, b in zip(gerr, g2))
    print("cudnn equals blockwise within bf16 tolerance" if ok else "MISMATCH between cudnn and blockwise")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(tyro.cli(Args))
