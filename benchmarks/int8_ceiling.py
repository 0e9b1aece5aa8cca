"""On a TPU: what bounds the decode kernel over an int8 cache: its bytes, their
conversion to bf16, or the rest of its fold.

Minimal Pallas kernels stream `--gib` of key and value blocks (each `[128 tokens x 8
kv heads, 128]`, the decode kernel's tile, `--rows-per-step` rows per grid step) from
HBM through VMEM, and do successively more of the decode kernel's work on each; 16
query heads. The median of `--repeats` calls of each, beside its bytes at the data
sheet's bandwidth:

- `dma`: the blocks land in VMEM; one tile of each is touched. The bandwidth ceiling.
- `matmuls`: `s = q k^T` and `s v` with bf16 operands (an int8 block converted to
  bf16), float32 accumulation: the MXU's work and, for int8, the conversion.
- `fold`: `matmuls` plus the decode kernel's masking and online softmax (no int8
  scales).
- `f32`: `matmuls` with an int8 block converted to float32 instead (one MXU pass).
- `int8_mxu` (int8 only): both matmuls on int8 operands (q and p rounded to int8),
  int32 accumulation: no conversion of the blocks.
- `scaled` (int8 with `--split True` only): `fold` with the int8 scales applied as
  the decode kernel applies them (`eqx_tx.kernels.decode_tpu.scale_columns`): row `c`
  of a block's `[8, 128]` tile holds the scales of its score columns `[128 c, 128 c +
  128)` (the tokens-major layout of `eqx_tx.kernels.quantized`), a slice of the tile
  broadcast over the query heads; the keys' row multiplies the scores, the values'
  the probabilities.

With `--split True` each step's blocks arrive as the decode kernel's do from a page
pool: one DMA per 128-token block, and for int8 two scale tiles per block beside it.

    python benchmarks/int8_ceiling.py
"""

import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from timing import median_times

from eqx_tx.kernels.decode_tpu import scale_columns

KV_HEADS, HEAD_DIM, HEADS, BLOCK = 8, 128, 16, 128
ROWS = BLOCK * KV_HEADS  # one block's rows, kv heads folded in
VARIANTS = ("dma", "matmuls", "fold", "f32", "int8_mxu", "scaled")


@dataclasses.dataclass(frozen=True)
class Args:
    gib: float = 2.0
    """Keys and values streamed per call, the same bytes for each dtype (a call has a
    fixed cost, ~0.6 ms on a v5e, which fewer bytes would carry a larger share of)."""
    blocks: int | None = None
    """128-token blocks streamed per call (keys and values each), instead of `--gib`."""
    rows_per_step: tuple[int, ...] = (1024, 4096)
    """Rows per grid step (1024: one 128-token block of 8 kv heads)."""
    split: tuple[bool, ...] = (False,)
    """Each step's rows as one DMA per operand (`False`), or (`True`) one per 128-token
    block, as the decode kernel reads a page pool, with an int8 block's two scale
    tiles (`[8 kv heads, 128 tokens]` float32 each) DMA'd beside it and touched, not
    applied."""
    dtypes: tuple[str, ...] = ("bf16", "int8")
    variants: tuple[str, ...] = VARIANTS
    repeats: int = 20
    bandwidth_gbs: float = 819.0
    """The roofline's bandwidth (TPU v5e data sheet)."""
    interpret: bool = False
    """Run in Pallas's interpreter (a check of the kernels off a TPU; no timing worth reading)."""


def _kernel(q_ref, *refs, variant: str, split: int, scales: bool):
    kv = refs[:2 * split]
    n = 2 * split + (2 * split if scales else 0)
    scale_refs = refs[2 * split:n]
    o_ref, acc_ref, m_ref, l_ref = refs[n:]

    @pl.when(pl.program_id(0) == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, -1e30, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    def cat(refs):  # the step's blocks as one array (each block its own DMA when split)
        return jnp.concatenate([r[...] for r in refs], axis=0) if len(refs) > 1 else refs[0][...]

    if variant != "scaled":
        for ref in scale_refs:  # DMA'd and touched, not applied: what their DMAs cost
            acc_ref[:8] += ref[...]
    if variant == "dma":
        for ref in kv:
            acc_ref[:8] += ref[:8].astype(jnp.float32)
    elif variant == "int8_mxu":
        q = q_ref[...].astype(jnp.int8)
        s = jax.lax.dot_general(q, cat(kv[:split]), (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        p = jnp.clip(s >> 12, -127, 127).astype(jnp.int8)
        acc_ref[...] += jax.lax.dot_general(p, cat(kv[split:]), (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.int32).astype(jnp.float32)
    else:
        dtype = jnp.float32 if variant == "f32" else jnp.bfloat16
        q = q_ref[...].astype(dtype)
        k, v = cat(kv[:split]).astype(dtype), cat(kv[split:]).astype(dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * 0.088
        if variant == "scaled":
            s = scale_columns(s, scale_refs[:split])
        if variant in ("fold", "scaled"):
            row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            ok = (col % KV_HEADS == row // (HEADS // KV_HEADS)) & (col // KV_HEADS < 100_000)
            s = jnp.where(ok, s, -1e30)
            m_prev = m_ref[...]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            s = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
            l_ref[...] = alpha * l_ref[...] + jnp.sum(s, axis=1, keepdims=True)
            m_ref[...] = m_new
            acc_ref[...] *= alpha[:, :1]
        if variant == "scaled":
            s = scale_columns(s, scale_refs[split:])
        acc_ref[...] += jax.lax.dot_general(s.astype(dtype), v, (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
    o_ref[...] = acc_ref[...] + l_ref[:, :1]


def stream(q, k, v, scales, *, variant: str, rows_per_step: int, split: bool, interpret: bool):
    """One pass of `variant` over every block of `k, v` (`[blocks * ROWS, HEAD_DIM]`):
    `rows_per_step` rows a grid step, as one DMA per operand, or (`split`) one per
    block, with (int8: `scales`, `[blocks, ROWS // 128, 128]` twice) each block's
    scale tile."""
    parts = rows_per_step // ROWS if split else 1
    rows = rows_per_step // parts

    def spec(b):
        return pl.BlockSpec((rows, HEAD_DIM), lambda i: (i * parts + b, 0))

    def scale_spec(b):
        return pl.BlockSpec((None, ROWS // 128, 128), lambda i: (i * parts + b, 0, 0))

    fixed = pl.BlockSpec((HEADS, HEAD_DIM), lambda i: (0, 0))
    in_specs, operands = [fixed] + [spec(b) for b in range(parts)] * 2, [q] + [k] * parts + [v] * parts
    if scales is not None:
        in_specs += [scale_spec(b) for b in range(parts)] * 2
        operands += [scales[0]] * parts + [scales[1]] * parts
    return pl.pallas_call(
        functools.partial(_kernel, variant=variant, split=parts, scales=scales is not None),
        grid=(k.shape[0] // rows_per_step,),
        in_specs=in_specs,
        out_specs=fixed,
        out_shape=jax.ShapeDtypeStruct((HEADS, HEAD_DIM), jnp.float32),
        scratch_shapes=[pltpu.VMEM((HEADS, HEAD_DIM), jnp.float32), pltpu.VMEM((HEADS, 128), jnp.float32),
                        pltpu.VMEM((HEADS, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(*operands)


def main(args: Args) -> None:
    if jax.default_backend() != "tpu" and not args.interpret:
        raise SystemExit(f"int8_ceiling compiles its kernels with Mosaic: it needs a TPU "
                         f"(backend is {jax.default_backend()}; --interpret checks them elsewhere)")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((HEADS, HEAD_DIM)), jnp.bfloat16)
    for dtype in args.dtypes:
        size = 1 if dtype == "int8" else 2
        blocks = args.blocks or int(args.gib * 2**30 / (2 * ROWS * HEAD_DIM * size))
        shape = (blocks * ROWS, HEAD_DIM)
        if dtype == "int8":
            k, v = (jax.device_put(rng.integers(-127, 128, shape, dtype=np.int8)) for _ in range(2))
        else:
            k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.key(0)))
        read = 2 * k.size * k.dtype.itemsize
        for rows, split in itertools.product(args.rows_per_step, args.split):
            scales = None
            if split and dtype == "int8":
                scales = tuple(jnp.ones((blocks, ROWS // 128, 128), jnp.float32) for _ in range(2))
            calls = {}
            for variant in args.variants:
                if (variant == "int8_mxu" and dtype != "int8") or (variant == "scaled" and scales is None):
                    continue
                fn = jax.jit(functools.partial(stream, variant=variant, rows_per_step=rows, split=split,
                                               interpret=args.interpret))
                try:
                    compiled = fn.lower(q, k, v, scales).compile()
                except Exception as e:  # one variant Mosaic refuses leaves the others measured
                    print(json.dumps({"kv": dtype, "rows_per_step": rows, "split": split, "variant": variant,
                                      "failed": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
                    continue
                calls[variant] = lambda c=compiled, k=k, v=v, s=scales: jax.block_until_ready(c(q, k, v, s))
            for variant, seconds in median_times(calls, args.repeats).items():
                print(json.dumps({"kv": dtype, "rows_per_step": rows, "split": split, "variant": variant,
                                  "ms": round(1e3 * seconds, 3), "us_per_block": round(1e6 * seconds / blocks, 3),
                                  "GB_per_s": round(read / seconds / 1e9, 1),
                                  "of_bandwidth": f"{read / seconds / 1e9 / args.bandwidth_gbs:.0%}"}), flush=True)
        del k, v


if __name__ == "__main__":
    main(tyro.cli(Args))
