"""Blockwise (flash) attention in pure JAX: O(T) memory forward and backward.

Queries are processed one block at a time; for each query block a loop over
key/value blocks keeps a running max and sum (online softmax), so at most one
`[block_q, block_kv]` tile of scores per head exists at once. The backward pass is
a custom VJP that recomputes each tile from the saved log-sum-exp (FlashAttention-2)
and accumulates `dq` in place, so nothing quadratic is ever stored.

Masking works on positions: key `j` of sequence `b` is visible to query `i` iff
`k_pos[b, j] < kv_lengths[b]` and, when causal, `k_pos[b, j] <= q_pos[b, i]`. By
default `k_pos` is the key index (a cache slot) and `q_pos = q_offset + i`: training
uses `q_offset = 0`, chunked prefill the chunk start, decode the current cache length.
Explicit position arrays (non-decreasing along each row) serve context parallelism,
where a device holds two distant chunks of the sequence.

Packed sequences add segment ids (`0`: padding, `1..k`: documents): a key is visible
only to queries of its own (non-zero) segment. Loops run only over the span of blocks
that can hold a visible key, so causal attention skips the fully masked upper
triangle, decode skips the unfilled part of the cache, and packed documents (ids
non-decreasing along the row) cost about what they cost alone.

GQA is handled by grouping the query heads of each key/value head
(`[batch, q, kv_heads, group, head_dim]`), never by repeating K/V.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.util import round_up
from .mask import visible
from .quantized import Quantized


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static settings of the raw kernel: causal masking, tile sizes, score scale."""

    causal: bool
    block_q: int
    block_kv: int
    scale: float
    segmented: bool = False


def _slice_kv(x, start, size, dtype):
    """Block `[start, start + size)` of keys or values; int8 blocks are dequantized here."""
    if isinstance(x, Quantized):
        block = Quantized(
            jax.lax.dynamic_slice_in_dim(x.values, start, size, axis=1),
            jax.lax.dynamic_slice_in_dim(x.scale, start, size, axis=1),
        )
        return block.dequantize(dtype)
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _pad_kv(x, size):
    if isinstance(x, Quantized):
        return Quantized(_pad_axis(x.values, size, 1), _pad_axis(x.scale, size, 1))
    return _pad_axis(x, size, 1)


def _pad_axis(x, size, axis):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


_NO_POSITION = jnp.iinfo(jnp.int32).max  # padded keys: never visible


_NO_SEGMENT = jnp.iinfo(jnp.int32).max


def _tile_mask(q_pos, k_pos, kv_lengths, causal, q_seg=None, k_seg=None):
    """`[batch, 1, 1, bq, bk]` visibility (`eqx_tx.kernels.mask.visible`) of keys at
    `k_pos [B, bk]` to queries at `q_pos [B, bq]` (with segments when given)."""
    shown = visible(q_pos, k_pos, kv_lengths, causal=causal, q_segments=q_seg, k_segments=k_seg, layout="rows")
    return shown[:, None, None]


def _heads_major(x, *, features=True):
    """A tile `[batch, n, kv_heads, ...]` moved to `[batch, kv_heads, ..., n, head_dim]`
    (`features=False`: `[batch, kv_heads, ..., n]`, for per-query values).

    Tiles are multiplied head-major (`[B, Hkv, G, bq, K]` with `[B, Hkv, bk, K]`) so that
    each score tile comes out of its matmul row-major as `[B, Hkv, G, bq, bk]`, the
    layout the mask, softmax and reductions read. (Contracting the stored
    `[B, n, Hkv, ...]` layouts directly made XLA:CPU emit the scores transposed and
    re-read them through a strided transpose in every elementwise pass: 2.4x slower.)
    Moving a tile is O(block), its matmuls O(block^2).
    """
    return jnp.moveaxis(x, 1, -2 if features else -1)


def _sequence_major(x, *, features=True):
    """The inverse of `_heads_major`."""
    return jnp.moveaxis(x, -2 if features else -1, 1)


def _block_bounds(q_pos, k_pos, bq, bk):
    """Per query block the largest position, per key block the smallest: `[n_q]`, `[n_kv]`."""
    q_max = jnp.max(q_pos.reshape(q_pos.shape[0], -1, bq), axis=(0, 2))
    k_min = jnp.min(k_pos.reshape(k_pos.shape[0], -1, bk), axis=(0, 2))
    return q_max, k_min


def _segment_bounds(seg, block):
    """Per row and block the smallest and largest non-zero segment id, `[B, n]` each
    (an all-padding block gets an empty range). Rows are kept apart: their ids are
    unrelated."""
    s = seg.reshape(seg.shape[0], -1, block)
    return jnp.min(jnp.where(s > 0, s, _NO_SEGMENT), axis=2), jnp.max(jnp.where(s > 0, s, -1), axis=2)


def _segments_overlap(blocks, one, i):
    """`[n]`: whether each of `blocks`' ranges shares a segment id with block `i` of
    `one`, in any row (both `(lo [B, n], hi [B, n])`)."""
    lo, hi = one[0][:, i, None], one[1][:, i, None]
    return jnp.any((blocks[1] >= lo) & (blocks[0] <= hi), axis=0)


def _span(needed):
    """First and one-past-last true index of a bool vector (`(0, 0)` if none): the
    blocks a loop visits. Blocks inside the span that are not needed are masked."""
    n = needed.shape[0]
    found = jnp.any(needed)
    return jnp.where(found, jnp.argmax(needed), 0), jnp.where(found, n - jnp.argmax(needed[::-1]), 0)


def _slice_segments(seg, start, size):
    return None if seg is None else jax.lax.dynamic_slice_in_dim(seg, start, size, axis=1)


def online_softmax_step(acc, s, v, pv_spec: str):
    """Fold one block of masked scores `s [..., q, keys]` (float32, `-inf` where
    invisible) and its values into the running `(out, max, sum)` of an online
    softmax; `pv_spec` is the einsum of probabilities and values into `out`."""
    o, m, l = acc
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum(pv_spec, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return alpha[..., None] * o + pv, m_new, l


def flash_forward(q, k, v, kv_lengths, q_pos, k_pos, static: Tiling, q_seg=None, k_seg=None):
    """The raw forward pass on the padded, grouped inputs of `prepare_blocks`.

    **Returns:** `o [B, Tp, Hkv, G, K]` (q dtype) and `lse [B, Tp, Hkv, G]` (float32).

    Positions are non-decreasing along rows, so the key blocks a query block needs
    form a span: those starting at or before its last query (causal), before the
    longest sequence's end and (packed) sharing a segment id with it.
    """
    bq, bk = static.block_q, static.block_kv
    B, Tp, Hkv, G, K = q.shape
    n_q = Tp // bq
    q_max, k_min = _block_bounds(q_pos, k_pos, bq, bk)
    needed_kv = k_min < jnp.max(kv_lengths)
    q_ranges = _segment_bounds(q_seg, bq) if static.segmented else None
    k_ranges = _segment_bounds(k_seg, bk) if static.segmented else None

    def q_block(i, carry):
        out, lse = carry
        q_i = _heads_major(jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1))
        q_pos_i = jax.lax.dynamic_slice_in_dim(q_pos, i * bq, bq, axis=1)
        q_seg_i = _slice_segments(q_seg, i * bq, bq)

        def kv_block(j, acc):
            o, m, l = acc
            k_j = _heads_major(_slice_kv(k, j * bk, bk, q.dtype))
            k_pos_j = jax.lax.dynamic_slice_in_dim(k_pos, j * bk, bk, axis=1)
            k_seg_j = _slice_segments(k_seg, j * bk, bk)
            # Zero values of invisible keys: stale cache slots may hold anything.
            v_j = _heads_major(_slice_kv(v, j * bk, bk, q.dtype))
            v_j = jnp.where((k_pos_j < kv_lengths[:, None])[:, None, :, None], v_j, 0)
            s = jnp.einsum("bhgqk,bhsk->bhgqs", q_i, k_j, preferred_element_type=jnp.float32)
            s = s * static.scale
            s = jnp.where(_tile_mask(q_pos_i, k_pos_j, kv_lengths, static.causal, q_seg_i, k_seg_j), s, -jnp.inf)
            return online_softmax_step((o, m, l), s, v_j, "bhgqs,bhsk->bhgqk")

        o0 = jnp.zeros((B, Hkv, G, bq, K), jnp.float32)
        m0 = jnp.full((B, Hkv, G, bq), -jnp.inf, jnp.float32)
        l0 = jnp.zeros((B, Hkv, G, bq), jnp.float32)
        visible = needed_kv & (k_min <= q_max[i]) if static.causal else needed_kv
        if q_ranges is not None and k_ranges is not None:
            visible = visible & _segments_overlap(k_ranges, q_ranges, i)
        lo, hi = _span(visible)
        o, m, l = jax.lax.fori_loop(lo, hi, kv_block, (o0, m0, l0))
        o = o / jnp.where(l > 0, l, 1.0)[..., None]
        lse_i = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        out = jax.lax.dynamic_update_slice_in_dim(out, _sequence_major(o).astype(out.dtype), i * bq, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, _sequence_major(lse_i, features=False), i * bq, axis=1)
        return out, lse

    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.zeros((B, Tp, Hkv, G), jnp.float32)
    return jax.lax.fori_loop(0, n_q, q_block, (out, lse))


def flash_backward(q, k, v, o, lse, do, dlse, kv_lengths, q_pos, k_pos, static: Tiling, q_seg=None, k_seg=None):
    """Float32 gradients w.r.t. the padded, grouped `q, k, v`, given the final `o, lse`.

    Exact per key block (FlashAttention-2): it only needs each query's final
    log-sum-exp, which is what lets ring attention visit key blocks one by one.
    """
    bq, bk = static.block_q, static.block_kv
    B, Tp, Hkv, G, K = q.shape
    n_q, n_kv = Tp // bq, k.shape[1] // bk
    q_max, k_min = _block_bounds(q_pos, k_pos, bq, bk)
    kv_max = jnp.max(kv_lengths)
    # D_i = rowsum(dO * O) - dlse_i: the softmax-Jacobian term; dlse enters as p * dlse.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse
    q_ranges = _segment_bounds(q_seg, bq) if static.segmented else None
    k_ranges = _segment_bounds(k_seg, bk) if static.segmented else None

    def kv_block(j, carry):
        dq, dk, dv = carry
        k_j = _heads_major(jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1))
        v_j = _heads_major(jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1))
        k_pos_j = jax.lax.dynamic_slice_in_dim(k_pos, j * bk, bk, axis=1)
        k_seg_j = _slice_segments(k_seg, j * bk, bk)

        def q_block(i, acc):
            dq, dk_j, dv_j = acc
            q_i, do_i = (_heads_major(jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1)) for x in (q, do))
            lse_i, delta_i = (
                _heads_major(jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1), features=False) for x in (lse, delta)
            )
            q_pos_i = jax.lax.dynamic_slice_in_dim(q_pos, i * bq, bq, axis=1)
            s = jnp.einsum("bhgqk,bhsk->bhgqs", q_i, k_j, preferred_element_type=jnp.float32)
            s = s * static.scale
            mask = _tile_mask(q_pos_i, k_pos_j, kv_lengths, static.causal, _slice_segments(q_seg, i * bq, bq), k_seg_j)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("bhgqs,bhgqk->bhsk", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhgqk,bhsk->bhgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None]) * static.scale
            dk_j = dk_j + jnp.einsum("bhgqs,bhgqk->bhsk", ds.astype(q.dtype), q_i, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bhgqs,bhsk->bhgqk", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
            dq_i = _sequence_major(dq_i) + jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, axis=1)
            return dq, dk_j, dv_j

        # Query blocks that see this key block: a span (positions are non-decreasing).
        needed = jnp.broadcast_to(k_min[j] < kv_max, (n_q,))
        if static.causal:
            needed = needed & (q_max >= k_min[j])
        if q_ranges is not None and k_ranges is not None:
            needed = needed & _segments_overlap(q_ranges, k_ranges, j)
        lo, hi = _span(needed)
        zeros = jnp.zeros((B, Hkv, bk, K), jnp.float32)
        dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, q_block, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, _sequence_major(dk_j), j * bk, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, _sequence_major(dv_j), j * bk, axis=1)
        return dq, dk, dv

    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    return jax.lax.fori_loop(0, n_kv, kv_block, (dq, dk, dv))


@eqx.filter_custom_vjp
def _flash(qkv, kv_lengths, q_pos, k_pos, segments, static):
    q, k, v = qkv
    return flash_forward(q, k, v, kv_lengths, q_pos, k_pos, static, *segments)


@_flash.def_fwd
def _flash_fwd(perturbed, qkv, kv_lengths, q_pos, k_pos, segments, static):
    q, k, v = qkv
    o, lse = flash_forward(q, k, v, kv_lengths, q_pos, k_pos, static, *segments)
    return (o, lse), (o, lse)


@_flash.def_bwd
def _flash_bwd(residuals, grads, perturbed, qkv, kv_lengths, q_pos, k_pos, segments, static):
    q, k, v = qkv
    o, lse = residuals
    do, dlse = grads
    do = jnp.zeros_like(o) if do is None else do
    dlse = jnp.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = flash_backward(q, k, v, o, lse, do, dlse, kv_lengths, q_pos, k_pos, static, *segments)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def prepare_blocks(q, k, v, *, kv_lengths, q_positions, k_positions, q_offset, causal, block_q, block_kv, scale,
                   q_segment_ids=None, kv_segment_ids=None):
    """Pad to whole blocks, group query heads by key/value head, build position arrays.

    Returns `((q5, k, v), kv_lengths, q_pos, k_pos, (q_seg, k_seg), static)`, the
    inputs of the raw `flash_forward` / `flash_backward` (used directly by ring
    attention); the segment arrays are `None` without segment ids.
    """
    B, T, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads {H} are not a multiple of key/value heads {Hkv}")
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != B or k.shape[3] != K:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    segmented = q_segment_ids is not None
    bq, bk = min(block_q, T), min(block_kv, S)
    static = Tiling(causal, bq, bk, float(K**-0.5 if scale is None else scale), segmented)
    if q_positions is None:
        q_positions = jnp.asarray(q_offset, jnp.int32).reshape(-1, 1) + jnp.arange(T, dtype=jnp.int32)
    if k_positions is None:
        k_positions = jnp.arange(S, dtype=jnp.int32)[None]
    q_positions = jnp.broadcast_to(q_positions.astype(jnp.int32), (B, T))
    k_positions = jnp.broadcast_to(k_positions.astype(jnp.int32), (B, S))
    kv_lengths = jnp.full((B,), S, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    q_pos = jnp.pad(q_positions, ((0, 0), (0, Tp - T)), constant_values=-1)
    k_pos = jnp.pad(k_positions, ((0, 0), (0, Sp - S)), constant_values=_NO_POSITION)
    q5 = _pad_axis(q, Tp, 1).reshape(B, Tp, Hkv, H // Hkv, K)
    segments = (None, None)
    if q_segment_ids is not None and kv_segment_ids is not None:
        segments = (_pad_axis(jnp.broadcast_to(q_segment_ids.astype(jnp.int32), (B, T)), Tp, 1),
                    _pad_axis(jnp.broadcast_to(kv_segment_ids.astype(jnp.int32), (B, S)), Sp, 1))
    return (q5, _pad_kv(k, Sp), _pad_kv(v, Sp)), kv_lengths, q_pos, k_pos, segments, static


def flash_attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized,
    v: Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized,
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    q_offset: int | Int[Array, " batch"] = 0,
    q_positions: Int[Array, "batch q_seq"] | None = None,
    k_positions: Int[Array, "batch kv_seq"] | None = None,
    q_segment_ids: Int[Array, "batch q_seq"] | None = None,
    kv_segment_ids: Int[Array, "batch kv_seq"] | None = None,
    causal: bool = True,
    block_q: int = 512,
    block_kv: int = 512,
    scale: float | None = None,
) -> tuple[Float[Array, "batch q_seq heads head_dim"], Float[Array, "batch q_seq heads"]]:
    """Blockwise attention with an online softmax and a recomputing backward.

    **Arguments:**

    - `q`, `k`, `v`: queries, keys and values; `heads` must be a multiple of `kv_heads`.
      Keys and values may be `Quantized` (int8 cache; forward only): each block is
      dequantized as it is read.
    - `kv_lengths`: keys at positions `>= kv_lengths[b]` are invisible (default: none).
    - `q_offset`: position of the first query per sequence (scalar or `[batch]`).
    - `q_positions`, `k_positions`: explicit positions, non-decreasing along each
      row (default: `q_offset + arange`, `arange`).
    - `q_segment_ids`, `kv_segment_ids`: packed documents (`0`: padding, `1..k`:
      documents; best non-decreasing along each row): a key is visible only to
      queries of its own non-zero segment. A query that sees no key gives `0`.
    - `causal`: whether keys at later positions than a query are hidden from it.
    - `block_q`, `block_kv`: tile sizes (clipped to the sequence lengths; any
      length works, the last block is padded and masked).
    - `scale`: score scale, default `1/sqrt(head_dim)`.

    **Returns:** the attention output (dtype of `q`) and the float32 log-sum-exp of
    each query's scores (`-inf` for a query that sees no key). Both are
    differentiable.
    """
    B, T, H, K = q.shape
    qkv, kv_lengths, q_pos, k_pos, segments, static = prepare_blocks(
        q, k, v, kv_lengths=kv_lengths, q_positions=q_positions, k_positions=k_positions, q_offset=q_offset,
        causal=causal, block_q=block_q, block_kv=block_kv, scale=scale, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    o, lse = _flash(qkv, kv_lengths, q_pos, k_pos, segments, static)
    Tp = q_pos.shape[1]
    return o.reshape(B, Tp, H, K)[:, :T], lse.reshape(B, Tp, H)[:, :T]


def merge_partials(
    o_a: Float[Array, "*rows head_dim"],
    lse_a: Float[Array, "*rows"],
    o_b: Float[Array, "*rows head_dim"],
    lse_b: Float[Array, "*rows"],
) -> tuple[Float[Array, "*rows head_dim"], Float[Array, "*rows"]]:
    """Combine two attention results over disjoint key sets into the result over their
    union, exactly, by their log-sum-exps (`-inf`: no visible key). **Returns** the
    float32 output and log-sum-exp."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    o = o_a.astype(jnp.float32) * jnp.exp(lse_a - safe)[..., None]
    return o + o_b.astype(jnp.float32) * jnp.exp(lse_b - safe)[..., None], lse
