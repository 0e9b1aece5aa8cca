"""Decode attention on a TPU: one query per sequence over a stacked cache, in place.

The caches stack every layer: a dense cache `[layers, batch, max_len, kv_heads,
head_dim]`, the engine's pool `[layers, pages, page_size, kv_heads, head_dim]`. Read
through XLA, one layer of either is first copied out of the stack (a `slice`, or
the pages gathered), then read by the attention: at batch 64 the copies of a
Qwen3-0.6B decode step took half of it (`benchmarks/results/accelerator_tpu_v5e.md`).
This Pallas (Mosaic) kernel reads the stack where it lies. The layer index, each
sequence's length and its block table are scalar-prefetched; grid step `(b, j)`
DMAs `n` blocks `table[b, j * n:(j + 1) * n]` of layer `layer` (each `[block,
kv_heads, head_dim]`, its own DMA; `n` from `tokens_per_step`: a grid step has a
fixed cost, which `n` blocks share) into VMEM and folds each into an online softmax.
A sequence's partial step is its first; a slot with no block re-names a live one
(`_first_slot`), so no bytes move for it (Pallas skips a DMA whose block index repeats
from the step before), and it is not computed.

A dense cache is the same thing viewed as blocks: `[layers, batch * max_len / block,
block, kv_heads, head_dim]` (a reshape, free) with block `j` of sequence `b` at
`b * max_len / block + j`.

Each block is read as `[block * kv_heads, head_dim]` (the cache viewed with its kv
heads folded into rows, a free reshape outside the kernel: the DMA lands it in the
tiles the MXU takes, in the cache's dtype) and every query head scores every row;
rows of other kv heads are masked. That multiplies the step's FLOPs by `kv_heads`,
which a decode step has to spare (a Qwen3-0.6B row reads 4 KiB per cached token for
64 kFLOP here: far below the MXU's rate per byte of HBM), in exchange for no relayout
of the block. The matmuls take bf16 operands (an int8 block converted, exactly),
accumulating in float32.

An int8 cache comes with float32 scales per (token, kv head), stored tokens-major in
rows of 128 lanes (`eqx_tx.kernels.quantized`): row `c` of a block's `[block * kv_heads
/ 128, 128]` tile holds the scales of its score columns `[128 c, 128 c + 128)`
(`scale_columns`). The scores are multiplied by the keys' scales and the
probabilities by the values' before `p @ v`, each 128 columns by one row of a tile,
broadcast over the query heads.

The masks that do not change (each query head's kv head) are made once per call in
VMEM; positions are masked only in the folds that hold a dead slot or a sequence's
last key. On a TPU v5e a minimal kernel that converts int8 blocks to bf16, runs both
matmuls and the online softmax on them and applies their scales this way, 512 tokens
a step, read them at 70% of the data sheet's bandwidth, within 3% of its DMAs alone
(`benchmarks/int8_ceiling.py`, `scaled`); with its scales stored heads-major and
spread over the columns by a 0/1 matmul each step, this kernel read them at 35-44%
(stop 54); stored this way, with each grid step's block ids found once in XLA (an
operand's index map one scalar load), at 56-69% (64 x 1,100 and 32 x 4,200, stop 56).
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int, Int8

from ..core.compute import ComputeConfig
from ..core.log import log_once
from ..core.util import ceil_div
from .flash import merge_partials
from .quantized import SCALE_LANES

_MASKED = -1e30


_LANES = 128
DENSE_BLOCK = 128  # tokens per block of a dense cache (`decode_attention_dense`)


def decode_tpu_reason(*, head_dim: int, kv_heads: int, heads: int, dtype, int8_block: int | None = None) -> str | None:
    """Why Mosaic cannot compile the kernel for these shapes on a TPU (`None` if it
    can; Pallas's interpreter takes any). `int8_block`: an int8 cache read in blocks
    of this many tokens (whole `[8, 128]` tiles of its scales per block)."""
    if int8_block is not None and (int8_block * kv_heads) % (8 * SCALE_LANES):
        return (f"int8 scales of {kv_heads} kv heads read in blocks of {int8_block} tokens (not a multiple of "
                f"{8 * SCALE_LANES} scales: whole tiles of 8 rows of {SCALE_LANES})")
    if int8_block is not None and SCALE_LANES % kv_heads:
        return (f"int8 scales of {kv_heads} kv heads (not a divisor of {SCALE_LANES}: a token's would straddle "
                "two rows)")
    if head_dim % 128:
        return f"head_dim {head_dim} is not a multiple of 128"
    if kv_heads % 8:
        return f"{kv_heads} kv heads per device (the kernel folds them into 8-row tiles)"
    if heads % kv_heads:
        return f"{heads} query heads do not group over {kv_heads} kv heads"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
        return f"dtype {jnp.dtype(dtype)}"
    return None


def scale_columns(x: Float[Array, "rows cols"], tiles: Sequence) -> Float[Array, "rows cols"]:
    """`x` with each `lanes` of its columns multiplied by one row of the scale `tiles`
    (in order, each `[rows_per_tile, lanes]`: the tokens-major layout of
    `eqx_tx.kernels.quantized`, 128 lanes), broadcast over `x`'s rows. `tiles` are
    arrays or VMEM refs (a ref is read a row at a time)."""
    rows = [tile[c:c + 1, :] for tile in tiles for c in range(tile.shape[0])]
    w = tiles[0].shape[1]
    chunks = [x[:, w * i:w * (i + 1)] * row for i, row in enumerate(rows)]
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=1)


def _kernel(layer_ref, lengths_ref, ids_ref, row_ref, step_ref, q_ref, *rest, step_blocks: int, block: int,
            kv_heads: int, group: int, scale: float, quantized: bool, concatenate: bool, with_lse: bool,
            aliased: bool):
    # The step's `step_blocks` key blocks, then as many value blocks; int8: as many key
    # scale and value scale tiles; (`aliased`) the outputs' initial values, untouched
    # here; then the output (and its log-sum-exp), the scratch: the online softmax's
    # state and the grouped-query mask. Each block is folded into the online softmax on
    # its own, or (`concatenate`) the step's blocks as one.
    outputs = 2 if with_lse else 1
    k_refs, v_refs = rest[:step_blocks], rest[step_blocks:2 * step_blocks]
    n = (4 if quantized else 2) * step_blocks
    ks_refs, vs_refs = rest[2 * step_blocks:3 * step_blocks], rest[3 * step_blocks:n]
    n += outputs if aliased else 0
    o_ref, lse_ref = rest[n], (rest[n + 1] if with_lse else None)
    m_ref, l_ref, acc_ref, bias_ref = rest[n + outputs:]
    t = pl.program_id(0)
    b, j = row_ref[t], step_ref[t]  # grid step t is step j of sequence b
    length = lengths_ref[b]  # 0: no keys (only when every sequence has none: a grid of one step)
    blocks = ceil_div(length, block)
    first = _first_slot(blocks, j, step_blocks=step_blocks)
    # Matmul operands in the cache's dtype (int8: bf16, exact), or q's where that is
    # wider; float32 accumulation.
    dtype = jnp.promote_types(q_ref.dtype, jnp.bfloat16 if quantized else k_refs[0].dtype)

    def fill(ref, value):  # ref[row, col] = value(row, col)
        row, col = (jax.lax.broadcasted_iota(jnp.int32, ref.shape, axis) for axis in (0, 1))
        ref[...] = value(row, col).astype(ref.dtype)

    @pl.when(t == 0)
    def _():  # the grid's constant: each query head's kv head
        fill(bias_ref, lambda r, c: jnp.where(c % kv_heads == r // group, 0.0, _MASKED))

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...].astype(dtype)  # [heads, head_dim]

    def cat(refs, blocks):
        return jnp.concatenate([refs[i][...] for i in blocks], axis=0) if len(blocks) > 1 else refs[blocks[0]][...]

    def fold(blocks, partial: bool):
        """Fold the step's `blocks` (consecutive, tokens from `start`) into the online
        softmax; `partial`: some of their positions lie outside `[0, length)` (a dead
        slot before the first block, or past the last key)."""
        start, cols = (first + blocks[0]) * block, len(blocks) * block * kv_heads
        k = cat(k_refs, blocks).astype(dtype)  # [tokens * kv_heads, head_dim]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if quantized:
            s = scale_columns(s, [ks_refs[i] for i in blocks])
        s = s * scale
        s = s + bias_ref[:, :cols]  # other kv heads' columns masked
        if partial:  # column c holds position start + c // kv_heads
            col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where((col >= -start * kv_heads) & (col < (length - start) * kv_heads), s, _MASKED)
        m_prev = m_ref[...]  # [heads, lanes], every lane the same
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        # Every row has a live column here (a fold holds a position in [0, length) and
        # each query head's kv head), so m_new is finite and a masked column's exp is 0.
        p = jnp.exp(s - m_new[:, :1])
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        if quantized:
            p = scale_columns(p, [vs_refs[i] for i in blocks])
        v = cat(v_refs, blocks).astype(dtype)
        pv = jax.lax.dot_general(p.astype(dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv
        m_ref[...] = m_new

    # A step's blocks are whole and live except in a sequence's first step (its dead
    # slots) and its last block (past the last key); only those folds mask positions.
    if concatenate:  # one fold of the step's live slots: all but a first step's `-first` dead ones
        whole = (first >= 0) & ((first + step_blocks) * block <= length)
        live = first * block < length
        pl.when(live & whole)(functools.partial(fold, tuple(range(step_blocks)), False))
        for dead in range(step_blocks):
            pl.when(live & ~whole & (jnp.maximum(-first, 0) == dead))(
                functools.partial(fold, tuple(range(dead, step_blocks)), True))
    else:  # block by block: a slot before the sequence's first block or past its last costs no compute
        for i in range(step_blocks):
            live = (first + i >= 0) & ((first + i) * block < length)
            if i < step_blocks - 1:  # a slot before the last holds no sequence's last block
                pl.when(live)(functools.partial(fold, (i,), False))
            else:
                whole = (first + i + 1) * block <= length
                pl.when(live & whole)(functools.partial(fold, (i,), False))
                pl.when(live & ~whole)(functools.partial(fold, (i,), True))

    @pl.when(j == jnp.maximum(ceil_div(blocks, step_blocks), 1) - 1)
    def _():
        l = l_ref[...]  # 0 only without keys
        o_ref[...] = jnp.where(l[:, :1] > 0, acc_ref[...] / l[:, :1], 0.0).astype(o_ref.dtype)
        if lse_ref is not None:  # [heads, lanes], every lane the same
            lse_ref[...] = jnp.where(l > 0, m_ref[...] + jnp.log(l), -jnp.inf)


def _first_slot(blocks, j, *, step_blocks: int):
    """The block in slot 0 of grid step `j` of a sequence of `blocks` blocks:
    `j * step_blocks` less the step's dead slots, so that its first step, not its
    last, is the partial one.

    Each step's DMAs are issued during the step before; a partial last step would
    leave a sequence's last compute too short to cover the next sequence's first
    (full) step. A dead slot (block `< 0`, or past the last) names a live block: at
    the first step the one it reads at the second, past the last step the one it
    read at the last, so the index repeats and Pallas moves no bytes for it.
    """
    return j * step_blocks - (ceil_div(blocks, step_blocks) * step_blocks - blocks)


def kernel_options(compute: ComputeConfig, *, quantized: bool) -> dict:
    """The kernel's `tokens_per_step` for an int8 (`quantized`) or other cache, and
    `interpret` as `compute` asks: asked for by name (`decode_tpu`), off a TPU in
    Pallas's interpreter; chosen by `auto` (on a TPU only), compiled."""
    return dict(tokens_per_step=compute.decode_step_tokens(quantized),
                interpret=None if compute.attention == "decode_tpu" else False)


def _interpret(interpret: bool | None) -> bool:
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
        if interpret:
            log_once(f"decode attention kernel in Pallas's interpreter (backend is {jax.default_backend()})")
    return interpret


def decode_attention_blocks(
    q: Float[Array, "batch heads head_dim"],
    k: Float[Array, "layers blocks block kv_heads head_dim"] | Int8[Array, "layers blocks block kv_heads head_dim"],
    v: Float[Array, "layers blocks block kv_heads head_dim"] | Int8[Array, "layers blocks block kv_heads head_dim"],
    layer: Int[Array, ""],
    table: Int[Array, "batch blocks_per_seq"],
    lengths: Int[Array, " batch"],
    *,
    scales: tuple[Float[Array, "layers rows 1 scale_rows 128"], Float[Array, "layers rows 1 scale_rows 128"]]
    | None = None,
    tokens_per_step: int = 512,
    interpret: bool | None = None,
) -> Float[Array, "batch heads head_dim"]:
    """Attention of one query per sequence over its blocks of layer `layer`.

    **Arguments:**

    - `q`: each sequence's query (RoPE applied, unscaled).
    - `k`, `v`: every layer's blocks of keys/values (int8 with `scales`).
    - `layer`: the layer read.
    - `table`: sequence `b`'s blocks in order; only the first
      `ceil(lengths[b] / block)` are read (later entries may be anything). A row
      whose first entry is outside the blocks (`>= blocks`: an engine's padding row)
      has no keys and costs nothing: its output is zeros.
    - `lengths`: sequence `b` attends to its keys `[0, lengths[b])` (clipped to at
      least 1 and at most the table's blocks: a finished row whose writes were dropped
      still reads something, and never past its table).
    - `scales`: for int8 `k, v`, their float32 scales in one group
      (`eqx_tx.kernels.quantized`): block `i`'s are the `r = block * kv_heads / 128`
      rows `scales[:, i // n, 0, (i % n) * r:][:, :r]`, `n` the blocks per entry of
      the scales' second axis (a page pool's pages: `n = 1`; a dense cache's
      sequences). Blocks not in whole rows (the interpreter's small
      ones) are read as rows of `block * kv_heads` lanes.
    - `tokens_per_step`: each grid step reads this many tokens' blocks
      (`tokens_per_step // block`, at least one: each block one DMA, the step's
      fixed cost shared by them).
    - `interpret`: run in Pallas's interpreter (any backend; tests); `None`: off a
      TPU only (logged once).

    **Returns:** the attention output, like `q`.
    """
    out, _ = _blocks(q, k, v, layer, table, lengths, scales, tokens_per_step=tokens_per_step, with_lse=False,
                     keyless=True, interpret=_interpret(interpret))
    return out


@functools.partial(jax.jit, static_argnames=("tokens_per_step", "with_lse", "keyless", "interpret"))
def _blocks(q, k, v, layer, table, lengths, scales, *, tokens_per_step: int, with_lse: bool, keyless: bool,
            interpret: bool):
    """The kernel; `keyless`: a row whose first table entry is outside the blocks has
    no keys (no grid step; its output zeros, its log-sum-exp -inf)."""
    B, N, H = q.shape
    _, num_blocks, block, K, _ = k.shape
    P = table.shape[1]
    n = max(1, min(tokens_per_step // block, P))  # blocks per grid step
    lengths = jnp.clip(lengths, 1, P * block).astype(jnp.int32)
    if keyless:
        lengths = jnp.where(table[:, 0] < num_blocks, lengths, 0)
    table = jnp.clip(table, 0, num_blocks - 1).reshape(-1).astype(jnp.int32)

    # One grid axis over every sequence's own steps (a dynamic bound): a short sequence
    # beside a long one costs its own steps, not the longest's (long-tailed RL batches).
    # Grid step t reads blocks `ids[t * n:(t + 1) * n]` (see `_first_slot`), found here
    # for every step at once: an operand's index map, which the pipeline evaluates for
    # each operand at each step (int8: 4n operands), is one scalar load.
    steps = ceil_div(ceil_div(lengths, block), n)  # [B]; 0 without keys
    ends = jnp.cumsum(steps)
    at = jnp.arange(B * ceil_div(P, n), dtype=jnp.int32)
    row_of = jnp.minimum(jnp.searchsorted(ends, at, side="right", method="scan_unrolled"), B - 1).astype(jnp.int32)
    step_of = (at - ends[row_of] + steps[row_of]).astype(jnp.int32)
    seq_blocks = jnp.maximum(ceil_div(lengths[row_of], block), 1)[:, None]
    slot = _first_slot(seq_blocks, step_of[:, None], step_blocks=n) + jnp.arange(n)[None, :]
    slot = jnp.clip(jnp.where(slot < 0, slot + n, slot), 0, seq_blocks - 1)
    ids = table[row_of[:, None] * P + slot].reshape(-1)

    def block_id(t, i, lengths_ref, ids_ref, row_ref, step_ref):
        """The block operand `i` reads at grid step `t`."""
        return ids_ref[t * n + i]

    def kv_spec(i):
        def index(t, layer_ref, *refs):
            return layer_ref[0], block_id(t, i, *refs), 0, 0

        return pl.BlockSpec((None, None, block * K, H), index)

    def row_spec(last):  # sequence b's own block
        return pl.BlockSpec((None, N, last), lambda t, layer_ref, lengths_ref, ids_ref, row_ref, step_ref: (
            row_ref[t], 0, 0))

    q_spec = row_spec(H)
    concatenate = scales is not None and n > 1
    fold_cols = (n if concatenate else 1) * block * K  # the score columns of one fold
    scratch = [pltpu.VMEM((N, 128), jnp.float32), pltpu.VMEM((N, 128), jnp.float32), pltpu.VMEM((N, H), jnp.float32),
               pltpu.VMEM((N, fold_cols), jnp.float32)]
    in_specs = [q_spec] + [kv_spec(i) for i in range(n)] * 2
    flat = k.reshape(k.shape[0], num_blocks, block * K, H), v.reshape(v.shape[0], num_blocks, block * K, H)
    operands = [q] + [flat[0]] * n + [flat[1]] * n
    if scales is not None:
        L, seqs, groups, rows, lanes = scales[0].shape
        width, per_row = block * K, num_blocks // seqs  # a block's scales; blocks per sequence (or page)
        if groups != 1 or rows * lanes < per_row * width:
            raise ValueError(f"int8 scales {scales[0].shape} are not one group of {K} kv heads holding {per_row} "
                             f"blocks of {block} tokens per row (eqx_tx.kernels.quantized)")
        if width % lanes:  # blocks not in whole rows (the interpreter's small ones): a row of `width` lanes each
            lanes = width
            scales = tuple(x.reshape(L, seqs, rows * x.shape[-1])[..., :per_row * width].reshape(
                L, seqs, 1, per_row, width) for x in scales)
        tile = width // lanes  # a block's rows of scales

        def scale_spec(i):
            def index(t, layer_ref, *refs):
                at = block_id(t, i, *refs)
                return layer_ref[0], at // per_row, 0, at % per_row, 0

            return pl.BlockSpec((None, None, None, tile, lanes), index)

        in_specs += [scale_spec(i) for i in range(n)] * 2
        operands += [scales[0]] * n + [scales[1]] * n
    out_specs, out_shape = [q_spec], [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if with_lse:  # [batch, heads, lanes], every lane the same (a whole tile per row)
        out_specs.append(row_spec(_LANES))
        out_shape.append(jax.ShapeDtypeStruct((B, N, _LANES), jnp.float32))
    aliases = {}
    if keyless:  # a row without keys is never visited: its outputs keep these values (in place)
        inits = [jnp.zeros(q.shape, q.dtype), jnp.full((B, N, _LANES), -jnp.inf, jnp.float32)][:len(out_shape)]
        aliases = {5 + len(operands) + i: i for i in range(len(inits))}  # counting the 5 scalar-prefetch operands
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(inits)
        operands += inits
    # At least one grid step: without any keys, it writes the last row's outputs as their initial values.
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=5, grid=(jnp.maximum(ends[-1], 1),),
                                             in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)
    # int8 blocks are bound by their compute, not their DMAs: one fold per step shares
    # its fixed costs (at stop 46, a concatenating form read 4k x 32 int8 at 23.9 ms a
    # step where folding block by block took 29-31).
    kernel = functools.partial(_kernel, step_blocks=n, block=block, kv_heads=K, group=N // K, scale=H**-0.5,
                               quantized=scales is not None, concatenate=concatenate,
                               with_lse=with_lse, aliased=keyless)
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths, ids, row_of, step_of, *operands)
    return outs[0], (outs[1] if with_lse else None)


def dense_block(max_len: int, preferred: int = 512) -> int:
    """The largest power of two up to `preferred` that divides `max_len` (a dense
    cache's rows are read in blocks of this many tokens)."""
    block = preferred
    while max_len % block:
        block //= 2
    return block


def decode_attention_dense(
    q: Float[Array, "batch 1 heads head_dim"],
    k: Float[Array, "layers batch max_len kv_heads head_dim"] | Int8[Array, "layers batch max_len kv_heads head_dim"],
    v: Float[Array, "layers batch max_len kv_heads head_dim"] | Int8[Array, "layers batch max_len kv_heads head_dim"],
    layer: Int[Array, ""],
    lengths: Int[Array, " batch"],
    *,
    scales: tuple[Float[Array, "layers batch 1 scale_rows 128"], Float[Array, "layers batch 1 scale_rows 128"]]
    | None = None,
    block: int = DENSE_BLOCK,
    tokens_per_step: int = 512,
    interpret: bool | None = None,
) -> Float[Array, "batch 1 heads head_dim"]:
    """`decode_attention_blocks` over layer `layer` of a dense stacked cache, read in
    place in blocks of `dense_block(max_len, block)` tokens, `tokens_per_step` tokens'
    worth per grid step. The block does not grow with the cache (128 for any multiple
    of 128: what the TPU measurements read), so a cache padded to a length bucket is
    read as one of its exact size would be.

    `scales`, `tokens_per_step`, `interpret`: as for `decode_attention_blocks` (a
    dense cache's scales are already one sequence per row).
    """
    out, _ = _dense(q, k, v, layer, lengths, scales, None, block=block, tokens_per_step=tokens_per_step,
                    with_lse=False, interpret=interpret)
    return out


def decode_attention_dense_with_lse(
    q: Float[Array, "batch 1 heads head_dim"],
    k: Float[Array, "layers rows max_len kv_heads head_dim"] | Int8[Array, "layers rows max_len kv_heads head_dim"],
    v: Float[Array, "layers rows max_len kv_heads head_dim"] | Int8[Array, "layers rows max_len kv_heads head_dim"],
    layer: Int[Array, ""],
    lengths: Int[Array, " batch"],
    *,
    scales: tuple[Float[Array, "layers rows 1 scale_rows 128"], Float[Array, "layers rows 1 scale_rows 128"]]
    | None = None,
    rows: Int[Array, " batch"] | None = None,
    block: int = DENSE_BLOCK,
    tokens_per_step: int = 512,
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch 1 heads head_dim"], Float[Array, "batch 1 heads"]]:
    """`decode_attention_dense`, with each query's log-sum-exp of its scaled scores
    (float32), to merge with attention over other keys (`flash.merge_partials`).

    `rows`: the cache row each query reads (default: its own; several queries may
    read one row, as the samples of a shared prompt do).
    """
    out, lse = _dense(q, k, v, layer, lengths, scales, rows, block=block, tokens_per_step=tokens_per_step,
                      with_lse=True, interpret=interpret)
    assert lse is not None
    return out, lse


def decode_attention_shared_with_lse(
    q: Float[Array, "batch 1 heads head_dim"],
    k: Float[Array, "layers rows max_len kv_heads head_dim"] | Int8[Array, "layers rows max_len kv_heads head_dim"],
    v: Float[Array, "layers rows max_len kv_heads head_dim"] | Int8[Array, "layers rows max_len kv_heads head_dim"],
    layer: Int[Array, ""],
    lengths: Int[Array, " rows"],
    *,
    samples: int,
    scales: tuple[Float[Array, "layers rows 1 scale_rows 128"], Float[Array, "layers rows 1 scale_rows 128"]]
    | None = None,
    max_query_rows: int = 128,
    block: int = DENSE_BLOCK,
    tokens_per_step: int = 512,
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch 1 heads head_dim"], Float[Array, "batch 1 heads"]]:
    """`decode_attention_dense_with_lse` for `samples` consecutive queries per cache row
    (query `b` reads row `b // samples`: the samples of a shared prompt), each row read
    once per group of its queries instead of once per query.

    A group is as many of a row's samples as fit in `max_query_rows` query rows
    (samples x heads; a divisor of `samples`): one grid row of the kernel, its queries
    ordered kv head by kv head (each kv head's query heads of every sample of the
    group), so the kernel's grouped-query masking serves them unchanged. It computes
    what one query per grid row would; only the cache's bytes are read fewer times.

    `scales`, `block`, `tokens_per_step`, `interpret`: as for `decode_attention_dense`.
    """
    B, _, N, H = q.shape
    K = k.shape[3]
    if B % samples or N % K:
        raise ValueError(f"{B} queries of {N} heads do not group as {samples} samples over {K} kv heads")
    per = max(d for d in range(1, samples + 1) if samples % d == 0 and (d == 1 or d * N <= max_query_rows))
    R = B // per  # grid rows
    rows = jnp.arange(R) // (samples // per)
    out, lse = _dense(_group_queries(q[:, 0], per, K)[:, None], k, v, layer, lengths[rows], scales, rows,
                      block=block, tokens_per_step=tokens_per_step, with_lse=True, interpret=interpret)
    assert lse is not None
    return _ungroup_queries(out[:, 0], per, K)[:, None], _ungroup_queries(lse[:, 0], per, K)[:, None]


def decode_attention_blocks_shared(
    q: Float[Array, "batch heads head_dim"],
    k: Float[Array, "layers blocks block kv_heads head_dim"] | Int8[Array, "layers blocks block kv_heads head_dim"],
    v: Float[Array, "layers blocks block kv_heads head_dim"] | Int8[Array, "layers blocks block kv_heads head_dim"],
    layer: Int[Array, ""],
    table: Int[Array, "batch blocks_per_seq"],
    lengths: Int[Array, " batch"],
    *,
    rows: int,
    scales: tuple[Float[Array, "layers rows 1 scale_rows 128"], Float[Array, "layers rows 1 scale_rows 128"]]
    | None = None,
    tokens_per_step: int = 512,
    interpret: bool | None = None,
) -> Float[Array, "batch heads head_dim"]:
    """`decode_attention_blocks`, with the leading blocks that `rows` consecutive
    sequences share read once for all of them.

    Each run of `rows` sequences (the batch in order; a run starts with a live
    sequence, and padding rows, whose first table entry is outside the pool, take no
    part) holds its longest common run of leading table entries, cut to the blocks that
    lie wholly before every member's last key: `m` blocks. The run's queries attend to
    those `m` blocks in one grid row of the kernel (its queries grouped kv head by kv
    head, as `decode_attention_shared_with_lse` groups a prompt's samples), each
    sequence to its blocks after them on its own, and the two parts are merged by their
    log-sum-exps: the same attention, with the shared blocks' bytes read once per run
    instead of once per sequence. A run that shares nothing (`m = 0`), and a padding row,
    cost no grid step. The batch must be a multiple of `rows`.

    Arguments as for `decode_attention_blocks`.
    """
    B, N, _ = q.shape
    _, num_blocks, block, K, _ = k.shape
    if B % rows:
        raise ValueError(f"a batch of {B} sequences does not split into runs of {rows}")
    P, interpret = table.shape[1], _interpret(interpret)
    lengths = jnp.clip(lengths, 1, P * block)
    live = table[:, 0] < num_blocks  # a padding row holds no block
    runs, live_runs = table.reshape(B // rows, rows, P), live.reshape(B // rows, rows)
    same = jnp.all((runs == runs[:, :1]) | ~live_runs[..., None], axis=1)  # [runs, P]: the live rows agree
    last = jnp.min(jnp.where(live_runs, ((lengths - 1) // block).reshape(B // rows, rows), P), axis=1)
    shared = jnp.where(live_runs[:, 0], jnp.minimum(jnp.sum(jnp.cumprod(same, axis=1), axis=1), last), 0)
    prefix = jnp.where(shared[:, None] > 0, runs[:, 0], num_blocks)  # a run that shares nothing has no keys
    o_pre, lse_pre = _blocks(_group_queries(q, rows, K), k, v, layer, prefix, shared * block, scales,
                             tokens_per_step=tokens_per_step, with_lse=True, keyless=True, interpret=interpret)
    assert lse_pre is not None
    skip = jnp.where(live, jnp.repeat(shared, rows), 0)  # [B]
    after = jnp.take_along_axis(table, jnp.minimum(jnp.arange(P)[None, :] + skip[:, None], P - 1), axis=1)
    o_own, lse_own = _blocks(q, k, v, layer, after, lengths - skip * block, scales,
                             tokens_per_step=tokens_per_step, with_lse=True, keyless=True, interpret=interpret)
    assert lse_own is not None
    lse_pre = jnp.where(skip[:, None] > 0, _ungroup_queries(lse_pre[..., 0], rows, K), -jnp.inf)
    o, _ = merge_partials(o_own, lse_own[..., 0], _ungroup_queries(o_pre, rows, K), lse_pre)
    return o.astype(q.dtype)


def _group_queries(x: Array, per: int, kv_heads: int) -> Array:
    """`[B, N, ...]` -> `[B / per, kv_heads * per * N / kv_heads, ...]`: each run of
    `per` rows' query heads as one row's, kv head by kv head (each kv head's query heads
    of every row of the run), so the kernel's grouped-query masking serves them."""
    B, N, rest = x.shape[0], x.shape[1], x.shape[2:]
    G = N // kv_heads
    return jnp.swapaxes(x.reshape(B // per, per, kv_heads, G, *rest), 1, 2).reshape(B // per, N * per, *rest)


def _ungroup_queries(x: Array, per: int, kv_heads: int) -> Array:
    """The inverse of `_group_queries`."""
    R, M, rest = x.shape[0], x.shape[1], x.shape[2:]
    G = M // (per * kv_heads)
    return jnp.swapaxes(x.reshape(R, kv_heads, per, G, *rest), 1, 2).reshape(R * per, M // per, *rest)


def _dense(q, k, v, layer, lengths, scales, rows, *, block: int, tokens_per_step: int, with_lse: bool,
           interpret: bool | None):
    """The dense cache as blocks, row `rows[b]` (default `b`) read by query `b`."""
    L, R, S, K, H = k.shape
    blk = dense_block(S, block)
    blocks = k.reshape(L, R * (S // blk), blk, K, H), v.reshape(L, R * (S // blk), blk, K, H)
    rows = jnp.arange(q.shape[0]) if rows is None else rows
    table = rows[:, None] * (S // blk) + jnp.arange(S // blk)[None, :]
    out, lse = _blocks(q[:, 0], *blocks, layer, table, lengths, scales, tokens_per_step=tokens_per_step,
                       with_lse=with_lse, keyless=False, interpret=_interpret(interpret))
    return out[:, None], (None if lse is None else lse[:, None, :, 0])
