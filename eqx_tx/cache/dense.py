"""A preallocated key/value cache, stacked over layers, optionally int8.

`KVCache` holds `[layers, batch, max_len, kv_heads, head_dim]` keys and values.
With `dtype="int8"` they are stored as int8 with a float32 scale per (token, kv
head): `x ≈ q * scale`, `scale = max|x| / 127` over `head_dim`. That is
`(head_dim + 4) / (2 * head_dim)` of a bf16 cache (51.6% at head_dim 128).
Quantization happens on write; attention dequantizes one key/value block at a time
(`eqx_tx.kernels.flash`), never the whole cache.

`SharedPrefixCache` stores each prompt's keys/values once for `n` samples.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..kernels.quantized import Quantized
from ..core.sharding import HasAxes
from .storage import store_kv, zero_kv
from .paged import PagedKVCache

KV_AXES = ("layers", "cache_batch", "cache_seq", "cache_kv_heads", "head_dim")
SCALE_AXES = ("layers", "cache_batch", "cache_seq", "cache_kv_heads")


class KVCache(HasAxes):
    """Keys and values of every layer, `[layers, batch, max_len, kv_heads, head_dim]`.

    Slot `t` of sequence `b` holds the key/value of position `t`. The cache is carried
    through the scan over layers and written with a scatter, so under buffer donation
    XLA updates it in place (no per-layer copy of the whole cache).
    """

    k: Array
    v: Array
    k_scale: Float[Array, "layers batch max_len kv_heads"] | None
    v_scale: Float[Array, "layers batch max_len kv_heads"] | None

    def __init__(self, k, v, k_scale=None, v_scale=None):
        self.k = k
        self.v = v
        self.k_scale = k_scale
        self.v_scale = v_scale

    @classmethod
    def zeros(cls, *, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        return cls(*zero_kv((layers, batch, max_len, kv_heads, head_dim), dtype))

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"k": KV_AXES, "v": KV_AXES, "k_scale": SCALE_AXES, "v_scale": SCALE_AXES}

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def layer(self, index: Int[Array, ""]) -> tuple[Array | Quantized, Array | Quantized]:
        """Keys and values of layer `index`, `[batch, max_len, kv_heads, head_dim]`
        (as `Quantized` pairs for an int8 cache)."""
        pick = lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False)  # noqa: E731
        if self.quantized:
            return Quantized(pick(self.k), pick(self.k_scale)), Quantized(pick(self.v), pick(self.v_scale))
        return pick(self.k), pick(self.v)

    def write(
        self,
        index: Int[Array, ""],
        k_new: Float[Array, "batch seq kv_heads head_dim"],
        v_new: Float[Array, "batch seq kv_heads head_dim"],
        positions: Int[Array, "batch seq"],
    ) -> "KVCache":
        """Store `k_new, v_new` of layer `index` at slots `positions` (out-of-range: dropped)."""
        b = jnp.arange(k_new.shape[0])[:, None]
        if k_new.shape[0] == 1:
            # One row: XLA would make the scatter a dynamic-update-slice and fuse it into
            # the read of the layer that follows (`layer`), which then reads the old
            # cache; XLA:CPU keeps that alive by copying the whole stacked cache, two to
            # four times per layer and step. A second update, out of range (dropped),
            # keeps it a scatter, done in place (tests/test_generation.py checks).
            b = jnp.zeros((2, 1), jnp.int32)
            positions = jnp.concatenate([positions, jnp.full_like(positions, self.max_len)])
            k_new, v_new = jnp.concatenate([k_new, k_new]), jnp.concatenate([v_new, v_new])

        def put(buf, x):
            return buf.at[index, b, positions].set(x.astype(buf.dtype), mode="drop")

        return store_kv(self, put, k_new, v_new)


class SharedPrefixCache(eqx.Module):
    """The keys/values of `P` prompts stored once, and of their `P * n` completions.

    Sample `s` continues prompt `s // n`. Its attention reads the shared prompt
    cache and its own completion cache and merges the two by their log-sum-exp,
    which is exact. Completion slot `t` holds position `prompt_lengths[p] + t`.
    """

    prompt: KVCache  # [layers, P, prompt_len, ...]
    completion: KVCache  # [layers, P * n, max_new, ...]
    prompt_lengths: Int[Array, " prompts"]

    @property
    def n(self) -> int:
        return self.completion.k.shape[1] // self.prompt.k.shape[1]


Cache = KVCache | SharedPrefixCache | PagedKVCache
"""What a model reads and writes while sampling."""
