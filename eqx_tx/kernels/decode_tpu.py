"""Decode attention on a TPU: one query per sequence over a stacked cache, in place.

The caches stack every layer: a dense cache `[layers, batch, max_len, kv_heads,
head_dim]`, the engine's pool `[layers, pages, page_size, kv_heads, head_dim]`. Read
through XLA, one layer of either is first copied out of the stack (a `slice`, or
the pages gathered), then read by the attention: at batch 64 the copies of a
Qwen3-0.6B decode step took half of it (`benchmarks/results/accelerator_tpu_v5e.md`).
This Pallas (Mosaic) kernel reads the stack where it lies. The layer index, each
sequence's length and its block table are scalar-prefetched; grid step `(b, j)`
DMAs block `table[b, j]` of layer `layer` (`[block, kv_heads, head_dim]`) into VMEM
and folds it into an online softmax. Steps past a sequence's length re-name its last
block, so no bytes move for them (Pallas skips a DMA whose block index repeats).

A dense cache is the same thing viewed as blocks: `[layers, batch * max_len / block,
block, kv_heads, head_dim]` (a reshape, free) with block `j` of sequence `b` at
`b * max_len / block + j`.

Inside a step the block is `[block * kv_heads, head_dim]` (kv heads fold into rows,
free in float32 tiles) and every query head scores every row; rows of other kv heads
are masked. That multiplies the step's FLOPs by `kv_heads`, which a decode step has
to spare (a Qwen3-0.6B row reads 4 KiB per cached token for 64 kFLOP here: far
below the MXU's rate per byte of HBM), in exchange for no relayout of the block.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from ..core.log import log_once
from ..core.util import ceil_div

_MASKED = -1e30


INT8_REASON = "the cache is int8 (this kernel reads bf16/fp32 caches)"
"""Why the kernel cannot read an int8 cache, on any backend."""


def decode_tpu_reason(*, head_dim: int, kv_heads: int, heads: int, dtype) -> str | None:
    """Why Mosaic cannot compile the kernel for these shapes on a TPU (`None` if it
    can; Pallas's interpreter takes any)."""
    if head_dim % 128:
        return f"head_dim {head_dim} is not a multiple of 128"
    if kv_heads % 8:
        return f"{kv_heads} kv heads per device (the kernel folds them into 8-row tiles)"
    if heads % kv_heads:
        return f"{heads} query heads do not group over {kv_heads} kv heads"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
        return f"dtype {jnp.dtype(dtype)}"
    return None


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
            block: int, kv_heads: int, group: int, scale: float):
    b, j = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * block < length)
    def _():
        head_dim = q_ref.shape[-1]
        q = q_ref[...].astype(jnp.float32) * scale  # [heads, head_dim]
        k = k_ref[...].astype(jnp.float32).reshape(block * kv_heads, head_dim)
        v = v_ref[...].astype(jnp.float32).reshape(block * kv_heads, head_dim)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        ok = (col % kv_heads == row // group) & (j * block + col // kv_heads < length)
        s = jnp.where(ok, s, _MASKED)
        m_prev = m_ref[...]  # [heads, lanes], every lane the same
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv
        m_ref[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)


def _interpret(interpret: bool | None) -> bool:
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
        if interpret:
            log_once(f"decode attention kernel in Pallas's interpreter (backend is {jax.default_backend()})")
    return interpret


def decode_attention_blocks(
    q: Float[Array, "batch heads head_dim"],
    k: Float[Array, "layers blocks block kv_heads head_dim"],
    v: Float[Array, "layers blocks block kv_heads head_dim"],
    layer: Int[Array, ""],
    table: Int[Array, "batch blocks_per_seq"],
    lengths: Int[Array, " batch"],
    *,
    interpret: bool | None = None,
) -> Float[Array, "batch heads head_dim"]:
    """Attention of one query per sequence over its blocks of layer `layer`.

    **Arguments:**

    - `q`: each sequence's query (RoPE applied, unscaled).
    - `k`, `v`: every layer's blocks of keys/values.
    - `layer`: the layer read.
    - `table`: sequence `b`'s blocks in order; only the first
      `ceil(lengths[b] / block)` are read (later entries may be anything).
    - `lengths`: sequence `b` attends to its keys `[0, lengths[b])` (clipped to at
      least 1 and at most the table's blocks: a finished row whose writes were dropped
      still reads something, and never past its table).
    - `interpret`: run in Pallas's interpreter (any backend; tests); `None`: off a
      TPU only (logged once).

    **Returns:** the attention output, like `q`.
    """
    return _blocks(q, k, v, layer, table, lengths, interpret=_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _blocks(q, k, v, layer, table, lengths, *, interpret: bool):
    B, N, H = q.shape
    _, num_blocks, block, K, _ = k.shape
    P = table.shape[1]
    table = jnp.clip(table, 0, num_blocks - 1).reshape(-1).astype(jnp.int32)
    lengths = jnp.clip(lengths, 1, P * block).astype(jnp.int32)

    def kv_index(b, j, layer_ref, lengths_ref, table_ref):
        last = ceil_div(lengths_ref[b], block) - 1
        return layer_ref[0], table_ref[b * P + jnp.minimum(j, last)], 0, 0, 0

    kv_spec = pl.BlockSpec((None, None, block, K, H), kv_index)
    q_spec = pl.BlockSpec((None, N, H), lambda b, j, *_: (b, 0, 0))
    # The grid walks the longest sequence's blocks, not the table's width (a dynamic
    # bound: an engine's tables are as wide as its longest allowed sequence).
    steps = ceil_div(jnp.max(lengths), block)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B, steps),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((N, 128), jnp.float32), pltpu.VMEM((N, 128), jnp.float32),
                        pltpu.VMEM((N, H), jnp.float32)],
    )
    kernel = functools.partial(_kernel, block=block, kv_heads=K, group=N // K, scale=H**-0.5)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths, table, q, k, v)


def dense_block(max_len: int, preferred: int = 512) -> int:
    """The largest power of two up to `preferred` that divides `max_len` (a dense
    cache's rows are read in blocks of this many tokens)."""
    block = preferred
    while max_len % block:
        block //= 2
    return block


def decode_attention_dense(
    q: Float[Array, "batch 1 heads head_dim"],
    k: Float[Array, "layers batch max_len kv_heads head_dim"],
    v: Float[Array, "layers batch max_len kv_heads head_dim"],
    layer: Int[Array, ""],
    lengths: Int[Array, " batch"],
    *,
    block: int = 512,
    interpret: bool | None = None,
) -> Float[Array, "batch 1 heads head_dim"]:
    """`decode_attention_blocks` over layer `layer` of a dense stacked cache, read in
    place in blocks of `dense_block(max_len, block)` tokens.

    `interpret`: as for `decode_attention_blocks`.
    """
    L, B, S, K, H = k.shape
    blk = dense_block(S, block)
    blocks = k.reshape(L, B * (S // blk), blk, K, H), v.reshape(L, B * (S // blk), blk, K, H)
    table = jnp.arange(B)[:, None] * (S // blk) + jnp.arange(S // blk)[None, :]
    return decode_attention_blocks(q[:, 0], *blocks, layer, table, lengths, interpret=interpret)[:, None]
