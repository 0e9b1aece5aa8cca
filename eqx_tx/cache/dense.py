"""A preallocated key/value cache, stacked over layers, optionally int8.

`KVCache` holds `[layers, batch, max_len, kv_heads, head_dim]` keys and values.
With `dtype="int8"` they are stored as int8 with a float32 scale per (token, kv
head), `[layers, batch, groups, rows, lanes]` (tokens-major rows of 128 lanes,
`eqx_tx.kernels.quantized`):
`x ≈ q * scale`, `scale = max|x| / 127` over `head_dim`. That is
`(head_dim + 4) / (2 * head_dim)` of a bf16 cache (51.6% at head_dim 128).
Quantization happens on write; attention dequantizes one key/value block at a time
(`eqx_tx.kernels.flash`), never the whole cache.
"""

from typing import final

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..core.sharding import AnyMesh, HasAxes, mesh_axis_size
from ..kernels.decode_tpu import decode_attention_dense, kernel_options
from ..kernels.dispatch import CacheKind, select_attention
from ..kernels.mask import AttentionMask
from ..kernels.quantized import Quantized
from ..kernels.sdpa import attend
from .base import AbstractCache
from .storage import KVStorage, put_scale_rows, put_scale_windows, store_kv, zero_kv

KV_AXES = ("layers", "cache_batch", "cache_seq", "cache_kv_heads", "head_dim")
# Rows of at least this many tokens are written as one window each. On a TPU v5e an
# update costs ~60 ns a token written token by token (116 of 671 ms of a 4 x 8192
# prefill; 19 ms as windows), and ~3.3 us a row as a window (XLA writes the windows in
# a loop: a decode step at batch 64 took 26.2 ms with windows of one token, 14.3 ms
# without; `benchmarks/results/accelerator_tpu_v5e.md`, stop 51).
WINDOW_TOKENS = 64
SCALE_AXES = ("layers", "cache_batch", "cache_kv_heads", "cache_seq", None)


@final
class KVCache(AbstractCache, KVStorage, HasAxes):
    """Keys and values of every layer, `[layers, batch, max_len, kv_heads, head_dim]`.

    Slot `t` of sequence `b` holds the key/value of position `t`. The cache is carried
    through the scan over layers and written with a scatter, so under buffer donation
    XLA updates it in place (no per-layer copy of the whole cache).
    """

    k: Array
    v: Array
    k_scale: Float[Array, "layers batch groups rows lanes"] | None
    v_scale: Float[Array, "layers batch groups rows lanes"] | None

    def __init__(self, k, v, k_scale=None, v_scale=None):
        self.k = k
        self.v = v
        self.k_scale = k_scale
        self.v_scale = v_scale

    @classmethod
    def zeros(cls, *, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype,
              scale_groups: int = 1) -> "KVCache":
        return cls(*zero_kv((layers, batch, max_len, kv_heads, head_dim), dtype, scale_groups))

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"k": KV_AXES, "v": KV_AXES, "k_scale": SCALE_AXES, "v_scale": SCALE_AXES}

    @property
    def kind(self) -> CacheKind:
        return "int8" if self.quantized else "dense"

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def layer(self, index: Int[Array, ""]) -> tuple[Array | Quantized, Array | Quantized]:
        """Keys and values of layer `index`, `[batch, max_len, kv_heads, head_dim]`
        (as `Quantized` pairs for an int8 cache)."""
        return self.pair(lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False))

    def write(
        self,
        index: Int[Array, ""],
        k_new: Float[Array, "batch seq kv_heads head_dim"],
        v_new: Float[Array, "batch seq kv_heads head_dim"],
        positions: Int[Array, "batch seq"],
    ) -> "KVCache":
        """Store `k_new, v_new` of layer `index` at slots `positions`.

        Each row's positions are consecutive (`positions[b, 0] + arange(seq)`: one
        token decoded, or a prefill chunk), and lie wholly inside `[0, max_len)` or
        wholly outside it (then the row is dropped). From `WINDOW_TOKENS` tokens a row
        is written as one window of `seq` slots, else token by token."""
        B, seq = positions.shape
        rows = jnp.arange(B, dtype=positions.dtype)
        if B == 1:
            # One row: XLA would make the scatter a dynamic-update-slice and fuse it into
            # the read of the layer that follows (`layer`), which then reads the old
            # cache; XLA:CPU keeps that alive by copying the whole stacked cache, two to
            # four times per layer and step. A second update, out of range (dropped),
            # keeps it a scatter, done in place (tests/test_generation.py checks).
            rows = jnp.zeros((2,), positions.dtype)
            positions = jnp.concatenate([positions, jnp.full_like(positions, self.max_len)])
            k_new, v_new = jnp.concatenate([k_new, k_new]), jnp.concatenate([v_new, v_new])

        windows = seq >= WINDOW_TOKENS

        def put(buf, x):  # x [rows, seq, kv_heads, head_dim] into buf [layers, batch, max_len, ...]
            if windows:
                return _put_windows(buf, index, rows, positions[:, 0], x, seq_axis=2)
            return buf.at[index, rows[:, None], positions].set(x.astype(buf.dtype), mode="drop")

        def put_scale(buf, x):  # x [rows, seq, kv_heads] into buf [layers, batch, groups, rows, lanes]
            if windows:
                return put_scale_windows(buf, index, rows, positions[:, 0], x)
            return put_scale_rows(buf, (index, rows[:, None]), positions, x, self.max_len)

        return store_kv(self, put, put_scale, k_new, v_new)

    def attend(self, q, k, v, *, layer, positions, mask: AttentionMask, compute: ComputeConfig,
               mesh: AnyMesh | None):
        """Write, then attend over the cache's keys `[0, max_len)` of this layer.

        Queries from position 0 (a prefill's first chunk) see only this chunk's keys:
        causality hides every later slot of the cache. Attending over the chunk's own
        keys, as the cache stores them, is exact, reads `seq` keys instead of
        `max_len`, and is self-attention (which splash runs). Not for int8 caches,
        whose stored keys are the rounded ones.
        """
        own_keys = (not self.quantized and mask.segment_ids is None and mask.from_start
                    and mesh_axis_size(mesh, "sp") == 1)
        choice = select_attention(q.shape, k.shape if own_keys else self.k.shape[1:], q.dtype,
                                  cache="none" if own_keys else self.kind, q_offset=mask.q_offset, mesh=mesh,
                                  compute=compute, segmented=mask.segment_ids is not None)
        assert choice.backend in ("cudnn", "splash", "decode_tpu", "blockwise", "xla")
        with jax.named_scope("cache_write"):
            cache = self.write(layer, k, v, positions)
        if choice.backend == "decode_tpu":  # the stacked cache read in place, no slice of the layer
            lengths = positions[:, 0] + 1
            if mask.kv_lengths is not None:
                lengths = jnp.minimum(lengths, mask.kv_lengths)
            o = decode_attention_dense(q, *cache.values(), layer, lengths, scales=cache.scales,
                                       **kernel_options(compute, quantized=cache.scales is not None))
            return o, cache
        if own_keys:
            keys, values = k.astype(cache.dtype), v.astype(cache.dtype)
        else:
            keys, values = cache.layer(layer)
        kv_lengths = mask.kv_lengths
        if own_keys and kv_lengths is not None:  # a prompt longer than this chunk: its keys end here
            kv_lengths = jnp.minimum(kv_lengths, k.shape[1])
        o = attend(choice.backend, q, keys, values, kv_lengths=kv_lengths, q_offset=mask.q_offset,
                   segment_ids=mask.segment_ids, causal=True, block_q=choice.block_q, block_kv=choice.block_kv,
                   mesh=mesh)
        return o, cache


def _put_windows(buf: Array, index: Int[Array, ""], rows: Int[Array, " rows"], starts: Int[Array, " rows"],
                 x: Array, *, seq_axis: int) -> Array:
    """`buf[index, rows[r]]` with `x[r]` written from `starts[r]` along `seq_axis` (a
    window not wholly inside `buf`: dropped); one scatter of `len(rows)` windows."""
    indices = jnp.stack([jnp.broadcast_to(index, starts.shape).astype(starts.dtype), rows, starts], axis=-1)
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(1, x.ndim)), inserted_window_dims=(0, 1),
                                              scatter_dims_to_operand_dims=(0, 1, seq_axis))
    return jax.lax.scatter(buf, indices, x.astype(buf.dtype), numbers, indices_are_sorted=True, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
