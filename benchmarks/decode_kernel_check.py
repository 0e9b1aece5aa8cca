"""On a TPU: the decode kernel compiled by Mosaic against a float64 reference, and
what the int8 cache's scales cost in each layout.

- **layouts**: the bytes the device allocates for a Qwen3-0.6B-shaped page pool's
  float32 scales stored `[layers, pages, page_size, kv_heads]`, tokens-minor
  `[layers, pages, kv_heads, page_size]` and as the cache stores them, in rows of 128
  (`eqx_tx.kernels.quantized`), beside their logical size and the int8 values';
- **kernel**: `decode_attention_dense` and `decode_attention_blocks` (bf16 and int8,
  Qwen3-0.6B's 16 query and 8 kv heads of 128) against attention in float64 over the
  same (dequantized) keys and values: the largest absolute error.

    python benchmarks/decode_kernel_check.py
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from model_flops import kv_element_bytes

from eqx_tx.kernels.decode_tpu import decode_attention_blocks, decode_attention_dense
from eqx_tx.kernels.quantized import Quantized, scale_shape, stored_scales


def allocated_bytes(shape, dtype) -> int:
    """What the device's allocator holds for a zero array of `shape` (its tiled layout,
    padding included): `bytes_in_use` before and after (XLA's `memory_analysis`
    reports the logical size)."""
    before = jax.devices()[0].memory_stats()["bytes_in_use"]
    x = jax.jit(lambda: jnp.zeros(shape, dtype))()
    x.block_until_ready()
    used = jax.devices()[0].memory_stats()["bytes_in_use"] - before
    del x
    return used


def kernel_us(fn, *args, repeats: int = 20) -> float:
    """Median microseconds of `fn(*args)` (compiled first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e6 * float(np.median(times))


def reference(q, k, v, lengths):
    """float64 attention of `q [B, N, H]` over `k, v [B, S, K, H]`'s first `lengths[b]`."""
    B, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for n in range(N):
            keys, values = k[b, :lengths[b], n // G], v[b, :lengths[b], n // G]
            s = keys @ q[b, n] / np.sqrt(H)
            p = np.exp(s - s.max())
            out[b, n] = p / p.sum() @ values
    return out


def quantized(x):
    q = Quantized.quantize(jnp.asarray(x))
    return q.values, stored_scales(q.scale), np.asarray(q.dequantize(jnp.float32), np.float64)


def stored(k, v, dtype: str):
    """`k, v` as a cache of `dtype` stores them, their float64 values as it gives them
    back, and the int8 scales (as stored; `None` for bf16)."""
    if dtype == "bf16":
        kk, vv = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
        return (kk, vv), (np.asarray(kk, np.float64), np.asarray(vv, np.float64)), None
    (kk, ks, kd), (vv, vs, vd) = quantized(k), quantized(v)
    return (kk, vv), (kd, vd), (ks, vs)


def main() -> None:
    if jax.default_backend() != "tpu":
        raise SystemExit(f"decode_kernel_check compiles the kernel with Mosaic and reads the TPU allocator: "
                         f"it needs a TPU (backend is {jax.default_backend()})")
    L, pages, page, K, H, N = 28, 512, 128, 8, 128, 16
    rows = {"logical_scale_bytes": L * pages * page * K * 4,
            "scales_tokens_major": allocated_bytes((L, pages, page, K), jnp.float32),
            "scales_tokens_minor": allocated_bytes((L, pages, K, page), jnp.float32),
            "scales_rows_of_128": allocated_bytes(scale_shape((L, pages), page, K, 1), jnp.float32),
            "int8_values_bytes": allocated_bytes((L, pages, page, K, H), jnp.int8),
            "bf16_values_bytes": allocated_bytes((L, pages, page, K, H), jnp.bfloat16)}
    print(json.dumps({"layouts": rows}), flush=True)

    # One layer's decode attention alone: 64 rows of 1152 slots, 1100 live each.
    B, S = 64, 1152
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((1, B, S, K, H)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
    lengths = jnp.full((B,), 1100, jnp.int32)
    kq, ks, _ = quantized(k)
    for dtype, kk, scales in (("bf16", k, None), ("int8", kq, (ks, ks))):
        fn = jax.jit(lambda q, k, scales: decode_attention_dense(q, k, k, jnp.asarray(0), lengths, scales=scales))
        us = kernel_us(fn, q, kk, scales)
        read = 2 * B * 1100 * K * H * kv_element_bytes(H, dtype)
        print(json.dumps({"kernel_alone": dtype, "batch": B, "live": 1100, "us": round(us, 1),
                          "GB_per_s": round(read / us / 1e3, 1)}), flush=True)

    rng = np.random.default_rng(0)
    # Dense: 4 rows of 1024 slots, lengths inside a block, at an edge, whole, one key.
    Ld, B, S = 2, 4, 1024
    lengths = np.array([1, 300, 512, S])
    k, v = (rng.standard_normal((Ld, B, S, K, H)) * 2 for _ in range(2))
    q = rng.standard_normal((B, 1, N, H))
    for dtype in ("bf16", "int8"):
        (kk, vv), (kd, vd), scales = stored(k, v, dtype)
        for q_dtype in (jnp.bfloat16, jnp.float32):
            qq = jnp.asarray(q, q_dtype)
            out = decode_attention_dense(qq, kk, vv, jnp.asarray(1), jnp.asarray(lengths), scales=scales)
            want = reference(np.asarray(qq[:, 0], np.float64), kd[1], vd[1], lengths)
            err = float(np.max(np.abs(np.asarray(out[:, 0], np.float64) - want)))
            print(json.dumps({"kernel": "dense", "kv": dtype, "q": str(out.dtype), "max_abs_err": err}), flush=True)
    # A pool of shuffled pages read through tables.
    Lp, P = 2, 24
    k, v = (rng.standard_normal((Lp, P, page, K, H)) * 2 for _ in range(2))
    order = rng.permutation(P)
    table = order[:16].reshape(2, 8)
    lengths = np.array([1000, 129])
    q = rng.standard_normal((2, N, H))
    gathered = lambda x: np.stack([x[0, row].reshape(-1, K, H) for row in table])  # noqa: E731
    for dtype in ("bf16", "int8"):
        (kk, vv), (kd, vd), scales = stored(k, v, dtype)
        for q_dtype in (jnp.bfloat16, jnp.float32):
            qq = jnp.asarray(q, q_dtype)
            out = decode_attention_blocks(qq, kk, vv, jnp.asarray(0), jnp.asarray(table), jnp.asarray(lengths),
                                          scales=scales)
            want = reference(np.asarray(qq, np.float64), gathered(kd), gathered(vd), lengths)
            err = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
            print(json.dumps({"kernel": "pages", "kv": dtype, "q": str(out.dtype), "max_abs_err": err}), flush=True)


if __name__ == "__main__":
    main()
