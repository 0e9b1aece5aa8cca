"""On a TPU: attention alone, forward and forward+backward, for the pure-JAX blockwise
kernel and variants of JAX's splash kernel (tiles, keys per inner step, fused or
separate backward kernels, segment ids): the measurement behind the splash defaults of
`eqx_tx.kernels.splash` and `eqx_tx.kernels.dispatch.SPLASH_BLOCKS`.

Layout transposes (`[B, T, H, D]` <-> `[B, H, T, D]`) are included, as in the model.
FLOPs are causal: forward 4·B·H·T²/2·D, backward 2.5x that. Median of `--repeats`.

    python benchmarks/splash_tiles.py
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import tyro
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from timing import median_times

from eqx_tx.kernels.flash import flash_attention

# (block_q, block_kv, keys per inner step, fused backward, segment ids)
VARIANTS = [(512, 512, 512, True, True), (512, 512, 512, True, False), (512, 512, 512, False, False),
            (1024, 1024, 1024, True, False), (1024, 1024, 512, True, False), (1024, 1024, 1024, False, False),
            (512, 1024, 512, False, False), (1024, 512, 512, False, False), (2048, 1024, 512, False, False),
            (256, 1024, 512, False, False), (512, 2048, 512, False, False)]
# Forward alone (a prefill): larger tiles, which only the forward kernel's VMEM must hold.
FORWARD_VARIANTS = [(512, 512, 512), (1024, 1024, 512), (1024, 1024, 1024), (2048, 1024, 512), (1024, 2048, 512),
                    (2048, 2048, 512), (2048, 2048, 1024), (4096, 1024, 512), (4096, 2048, 512), (512, 2048, 512)]


@dataclasses.dataclass
class Args:
    batch: int = 4
    seq_len: int = 2048
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    repeats: int = 10
    forward_only: bool = False
    """Time the forward kernel alone, over `FORWARD_VARIANTS` (the prefill's tiles)."""


def splash_fn(args: Args, bq: int, bkv: int, bkv_compute: int, fused: bool, segmented: bool):
    T, D = args.seq_len, args.head_dim
    mask = sa.MultiHeadMask([sa.CausalMask((T, T))] * args.heads)
    blocks = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv_compute, block_q_dkv=bq, block_kv_dkv=bkv,
                           block_kv_dkv_compute=bkv_compute, use_fused_bwd_kernel=fused,
                           block_q_dq=None if fused else bq, block_kv_dq=None if fused else bkv)
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=blocks)
    segments = jnp.ones((args.batch, T), jnp.int32)

    def attention(q, k, v):
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * D**-0.5, k, v))
        if segmented:
            o = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(q, k, v, segments)
        else:
            o = jax.vmap(kernel)(q, k, v)
        return jnp.swapaxes(o, 1, 2)  # pyright: ignore[reportArgumentType]

    return attention


def main(args: Args) -> None:
    if jax.devices()[0].platform != "tpu":
        print(f"splash is a TPU kernel; the backend here is {jax.devices()[0].platform}", file=sys.stderr)
        sys.exit(2)
    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, H, D), jnp.bfloat16)
    k = jax.random.normal(kk, (B, T, args.kv_heads, D), jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, args.kv_heads, D), jnp.bfloat16)
    forward_flops = 4 * B * H * T * T / 2 * D
    print(f"B={B} T={T} heads {H}/{args.kv_heads} x {D}, bf16, on {jax.devices()[0].device_kind}; median of {args.repeats}")
    print("| kernel | forward | forward+backward |\n|---|---|---|")

    def row(name, f):
        forward = jax.jit(f)
        backward = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
        try:
            tf, tb = (median_times({"f": lambda f=f: jax.block_until_ready(f(q, k, v))}, args.repeats)["f"]
                      if f is not None else None for f in (forward, None if args.forward_only else backward))
        except Exception as e:  # a tiling the kernel refuses
            print(f"| {name} | did not run: {type(e).__name__}: {str(e).splitlines()[0][:150]} | |", flush=True)
            return
        both = "-" if args.forward_only else f"{tb * 1e3:.2f} ms ({3.5 * forward_flops / tb / 1e12:.0f} TFLOP/s)"
        print(f"| {name} | {tf * 1e3:.2f} ms ({forward_flops / tf / 1e12:.0f} TFLOP/s) | {both} |", flush=True)

    row("blockwise 512 x 512", lambda q, k, v: flash_attention(q, k, v, block_q=512, block_kv=512)[0])
    if args.forward_only:
        for bq, bkv, bkv_compute in FORWARD_VARIANTS:
            if not (T % bq or T % bkv):
                name = f"splash {bq} x {bkv}, {bkv_compute} keys per step"
                row(name, splash_fn(args, bq, bkv, bkv_compute, True, False))
        return
    for bq, bkv, bkv_compute, fused, segmented in VARIANTS:
        if T % bq or T % bkv:
            continue
        name = (f"splash {bq} x {bkv}, {bkv_compute} keys per step, {'fused backward' if fused else 'dq and dkv kernels'}"
                + (", segment ids" if segmented else ""))
        row(name, splash_fn(args, bq, bkv, bkv_compute, fused, segmented))


if __name__ == "__main__":
    main(tyro.cli(Args))
