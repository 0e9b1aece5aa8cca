"""How the caches store keys and values: as is, or int8 with a float32 scale per vector.

`KVStorage` declares the fields `k, v, k_scale, v_scale` (scales `None` unless int8)
that `KVCache` and `PagedKVCache` hold; `zero_kv` and `store_kv` create and write
them the same way for both.

Keys/values are `[..., tokens, kv_heads, head_dim]`; their scales are stored
`[..., groups, rows, lanes]`, tokens-major in rows of 128 lanes
(`eqx_tx.kernels.quantized` gives the layout): what the TPU decode kernel reads, a
row per 128 of its score columns (`eqx_tx.kernels.decode_tpu`). `KVStorage.pair`
hands them out as `Quantized` (`[..., tokens, kv_heads]`) all the same;
`put_scale_rows` and `put_scale_windows` write them.

On XLA:CPU a bf16 cache is stored as its uint16 bit patterns (`storage_dtype`):
XLA:CPU has no bf16 arithmetic, and a scatter into a bf16 buffer (or a read of a few
pages of one) converted the whole buffer to float32 and back, on every write: 30 ms
a write of 4 rows into a 34 MB pool, against 0.01 ms as uint16. The bits are viewed as
bf16 only once picked (`pair`, the pages a kernel gathers), so only those convert.
"""

from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.util import ceil_div
from ..kernels.quantized import BITS, Quantized, as_values, scale_shape, scales_by_token


def storage_dtype(dtype, platform: str):
    """How a cache of `dtype` is stored on `platform`: bf16 as `BITS` on CPU, else as is."""
    return BITS if jnp.dtype(dtype) == jnp.bfloat16 and platform == "cpu" else jnp.dtype(dtype)


class KVStorage(eqx.Module):
    """Keys and values (bf16 ones as `BITS` on XLA:CPU), and their float32 scales when
    stored as int8 (else `None`)."""

    k: eqx.AbstractVar[Array]
    v: eqx.AbstractVar[Array]
    k_scale: eqx.AbstractVar[Array | None]
    v_scale: eqx.AbstractVar[Array | None]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def dtype(self):
        """The keys' and values' dtype (int8 when quantized; bf16 when stored as `BITS`)."""
        return jnp.dtype(jnp.bfloat16) if self.k.dtype == BITS else self.k.dtype

    def values(self) -> tuple[Array, Array]:
        """The whole key and value arrays as values (int8 as stored; `BITS` viewed as
        bf16, which XLA:CPU copies: for the interpreted TPU kernel)."""
        return as_values(self.k), as_values(self.v)

    @property
    def scales(self) -> tuple[Array, Array] | None:
        """The key and value scales as stored (`[..., groups, rows, lanes]`), or `None` unless int8."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale, self.v_scale

    def pair(self, pick: Callable[[Array], Array]) -> tuple[Array | Quantized, Array | Quantized]:
        """`pick` applied to the keys and to the values (as `Quantized` pairs with their
        scales for int8; `pick` sees the scales as stored, its leading axes the
        keys', and they come back `[..., tokens, kv_heads]`; `BITS` come back as bf16)."""
        if self.scales is not None:
            k, v = pick(self.k), pick(self.v)
            tokens, kv_heads = k.shape[-3], k.shape[-2]
            k_scale, v_scale = (scales_by_token(pick(x), tokens, kv_heads) for x in self.scales)
            return Quantized(k, k_scale), Quantized(v, v_scale)
        return as_values(pick(self.k)), as_values(pick(self.v))


C = TypeVar("C", bound=KVStorage)


def zero_kv(shape: tuple[int, ...], dtype, scale_groups: int = 1) -> tuple[Array, Array, Array | None, Array | None]:
    """Zero `k, v` of `shape` `[..., tokens, kv_heads, head_dim]` (and, for int8, zero
    scales, their kv heads in `scale_groups` groups: `eqx_tx.kernels.quantized`)."""
    if jnp.dtype(dtype) == jnp.int8:
        scale = jnp.zeros(scale_shape(shape[:-3], shape[-3], shape[-2], scale_groups), jnp.float32)
        return jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scale, scale
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, None


def store_kv(cache: C, put: Callable[[Array, Array], Array], put_scale: Callable[[Array, Array], Array],
             k_new: Array, v_new: Array) -> C:
    """`cache` with `put(buffer, new)` applied to its keys and values (quantized first
    for an int8 cache, and `put_scale(scales, new [..., tokens, kv_heads])` to their
    scales; as bf16 bit patterns into `BITS`)."""
    if cache.scales is not None:
        kq, vq = Quantized.quantize(k_new), Quantized.quantize(v_new)
        k_scale, v_scale = cache.scales
        new = (put(cache.k, kq.values), put(cache.v, vq.values), put_scale(k_scale, kq.scale),
               put_scale(v_scale, vq.scale))
        return eqx.tree_at(lambda c: (c.k, c.v, c.k_scale, c.v_scale), cache, new)
    if cache.k.dtype == BITS:
        k_new, v_new = (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BITS) for x in (k_new, v_new))
    new = (put(cache.k, k_new), put(cache.v, v_new))
    return eqx.tree_at(lambda c: (c.k, c.v), cache, new)


def scale_groups(kv_heads: int, tp: int) -> int:
    """The groups an int8 cache's scales are stored in on a mesh with `tp`
    tensor-parallel devices: one per device's share of the kv heads where they split
    over `tp` (each device then holds its own heads' scales), else one."""
    return tp if tp > 1 and kv_heads % tp == 0 else 1


def _rows_of(scales: Array, kv_heads: int) -> tuple[int, int]:
    """A group's heads and the tokens to a row of `scales [..., groups, rows, lanes]`:
    position `p`'s scales are row `p // per_row`, lanes from `(p % per_row) * heads`."""
    heads = kv_heads // scales.shape[-3]
    if scales.shape[-1] % heads:
        raise ValueError(f"scales {scales.shape}: rows of {scales.shape[-1]} lanes do not hold whole tokens of "
                         f"{heads} heads (eqx_tx.kernels.quantized.scale_shape)")
    return heads, scales.shape[-1] // heads


def _in_row_order(x: Float[Array, "runs seq kv_heads"], groups: int) -> Float[Array, "runs groups lanes"]:
    """Each run's scales group by group, tokens-major with the group's heads minor
    (`seq * kv_heads / groups` lanes): the order a row of stored scales holds them in."""
    runs, seq, kv_heads = x.shape
    return jnp.swapaxes(x.reshape(runs, seq, groups, kv_heads // groups), 1, 2).reshape(runs, groups, -1)


def _shift_right(v: Float[Array, "runs groups width"], by: Int[Array, " runs"], step: int, most: int) -> Array:
    """Each run's `v` moved `by[r] * step` lanes right (`0 <= by[r] <= most`), zeros
    shifted in, the end cut off: one static shift and select per bit of `by`, all
    elementwise (a gather or a window at a run-time lane offset is a serial loop on a
    TPU)."""
    for bit in range(most.bit_length()):
        n = (1 << bit) * step
        moved = jnp.concatenate([jnp.zeros_like(v[..., :n]), v[..., :-n]], axis=-1)
        v = jnp.where(((by >> bit) & 1 == 1)[:, None, None], moved, v)
    return v


def put_scale_rows(scales: Float[Array, "*lead groups rows lanes"], lead: tuple[Array, ...],
                   positions: Int[Array, "runs seq"], x: Float[Array, "runs seq kv_heads"], tokens: int) -> Array:
    """`scales` with `x[r, t]` written at `(*lead[:][r, t], positions[r, t])`, where each
    run's positions are consecutive (a decoded token, or a chunk; in a page pool, from
    the end of one page on at the start of the next) and `tokens` is the length of the
    axis they index (a position outside `[0, tokens)`, or a lead index out of range:
    dropped). `lead`: indices into `scales`' leading axes, broadcast to `positions`.

    Written as whole rows of lanes: each row a run touches is read, the run's tokens
    placed in it, and written back once, by the run's first token in it (where rows
    tile the axis, only those tokens are looked at). On a TPU v5e a window of a token's
    `kv_heads` lanes, at a lane offset known only at run time, is written in a serial
    loop, ~3.3 us each (0.21 ms per layer and buffer at batch 64: decode at 22% of the
    roofline, where whole rows give 51%); placing the tokens by a gather of lanes took
    ~43 us per layer and buffer (2.4 ms a step), so a token is repeated over its row, and
    where rows tile the axis a run is shifted into its rows' lanes by `_shift_right`
    (`benchmarks/results/accelerator_tpu_v5e.md`, stops 56 and 57)."""
    groups, n_rows, lanes = scales.shape[-3:]
    runs, seq = positions.shape
    heads, per_row = _rows_of(scales, x.shape[-1])
    lead = tuple(jnp.broadcast_to(i, positions.shape) for i in lead)
    tiled = tokens % per_row == 0 or seq == 1  # rows start every `per_row` positions along a run
    if tiled:
        k = jnp.arange(min(seq, ceil_div(seq - 1, per_row) + 1))
        t = jnp.where(k == 0, 0, k * per_row - positions[:, :1] % per_row)  # [runs, rows touched]
        first = t < seq
        t = jnp.minimum(t, seq - 1)
    else:  # every token looked at; the first of its row writes it
        t = jnp.broadcast_to(jnp.arange(seq), positions.shape)
        first = (t == 0) | (positions % per_row == 0)
    at = jnp.take_along_axis(positions, t, axis=1)
    index = tuple(jnp.take_along_axis(i, t, axis=1).astype(jnp.int32) for i in lead)
    row = at // per_row
    old = scales[(*index, slice(None), jnp.clip(row, 0, n_rows - 1))]  # [runs, n, groups, lanes]
    # Lane l of token t's row holds this run's token j, head l % heads (when 0 <= j < seq).
    slot = jnp.arange(lanes) // heads
    j = t[..., None] + slot - (at % per_row)[..., None]  # [runs, n, lanes]
    flat = _in_row_order(x, groups).astype(scales.dtype)  # [runs, groups, seq * heads]
    if seq == 1:  # one token: its heads repeated over the row, the lanes of its slot kept (`mine`)
        placed = jnp.tile(flat, (1, 1, per_row))[:, None]
    elif tiled:  # row k holds the run's tokens from k * per_row - (its first position % per_row) on
        n = t.shape[1]
        flat = jnp.pad(flat, ((0, 0), (0, 0), (0, n * lanes - seq * heads)))
        flat = _shift_right(flat, positions[:, 0] % per_row, heads, per_row - 1)
        placed = jnp.swapaxes(flat.reshape(runs, groups, n, lanes), 1, 2)
    else:
        source = j * heads + jnp.arange(lanes) % heads
        placed = jnp.take_along_axis(flat[:, None], jnp.broadcast_to(jnp.clip(source, 0, seq * heads - 1)[:, :, None],
                                                                     old.shape), axis=-1)
    mine = (j >= 0) & (j < seq) & ((row * per_row)[..., None] + slot < tokens)
    new = jnp.where(mine[:, :, None], placed, old)  # lanes past the axis: kept
    writes = first & (at >= 0) & (at < tokens)
    return scales.at[(*index, slice(None), jnp.where(writes, row, n_rows))].set(new, mode="drop")


def put_scale_windows(scales: Float[Array, "layers batch groups rows lanes"], index: Int[Array, ""],
                      rows: Int[Array, " rows"], starts: Int[Array, " rows"],
                      x: Float[Array, "rows seq kv_heads"]) -> Array:
    """`scales[index, rows[r]]` with `x[r]` written at positions `[starts[r], starts[r]
    + seq)` (a window past the cache's tokens: dropped, as the keys' windows are): the
    rows it covers read, updated as one flat run and written back, two windows per
    row instead of a scatter per token."""
    _, _, groups, R, lanes = scales.shape
    n_rows, seq, kv_heads = x.shape
    heads, per_row = _rows_of(scales, kv_heads)
    span = min(R, ceil_div(seq, per_row) + 1)  # rows a window of `seq` tokens can cover
    first = jnp.clip(starts // per_row, 0, R - span)
    covered = jax.vmap(lambda b, r: jax.lax.dynamic_slice(scales, (index, b, 0, r, 0), (1, 1, groups, span, lanes)))(
        rows, first)[:, 0, 0]  # [rows, groups, span, lanes]
    run = jax.vmap(lambda c, n, at: jax.lax.dynamic_update_slice(c, n, (0, at)))(
        covered.reshape(n_rows, groups, span * lanes), _in_row_order(x, groups).astype(scales.dtype),
        (starts - first * per_row) * heads)
    inside = starts + seq <= R * per_row
    indices = jnp.stack([jnp.broadcast_to(index, rows.shape), rows, jnp.where(inside, first, R)], axis=-1)
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3), inserted_window_dims=(0, 1),
                                              scatter_dims_to_operand_dims=(0, 1, 3))
    return jax.lax.scatter(scales, indices.astype(jnp.int32), run.reshape(n_rows, groups, span, lanes), numbers,
                           indices_are_sorted=True, unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
