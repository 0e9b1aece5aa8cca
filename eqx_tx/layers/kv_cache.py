"""A preallocated key/value cache, stacked over layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..sharding import HasAxes

KV_AXES = ("cache_batch", "cache_seq", "cache_kv_heads", "head_dim")


class KVCache(HasAxes):
    """Keys and values of every layer: `[layers, batch, max_len, kv_heads, head_dim]`.

    Slot `t` of sequence `b` holds the key/value of position `t`. The cache is carried
    through the scan over layers and written with a scatter, so under buffer donation
    XLA updates it in place (no per-layer copy of the whole cache).
    """

    k: Float[Array, "layers batch max_len kv_heads head_dim"]
    v: Float[Array, "layers batch max_len kv_heads head_dim"]

    def __init__(self, k, v):
        self.k = k
        self.v = v

    @classmethod
    def zeros(cls, *, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def param_axes(self):
        return {"k": KV_AXES, "v": KV_AXES}

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def layer(self, index: Int[Array, ""]) -> tuple[Array, Array]:
        """Keys and values of layer `index`, `[batch, max_len, kv_heads, head_dim]`."""
        return (
            jax.lax.dynamic_index_in_dim(self.k, index, axis=0, keepdims=False),
            jax.lax.dynamic_index_in_dim(self.v, index, axis=0, keepdims=False),
        )

    def write(
        self,
        index: Int[Array, ""],
        k_new: Float[Array, "batch seq kv_heads head_dim"],
        v_new: Float[Array, "batch seq kv_heads head_dim"],
        positions: Int[Array, "batch seq"],
    ) -> "KVCache":
        """Store `k_new, v_new` of layer `index` at slots `positions` (out-of-range: dropped)."""
        b = jnp.arange(k_new.shape[0])[:, None]
        k = self.k.at[index, b, positions].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[index, b, positions].set(v_new.astype(self.v.dtype), mode="drop")
        return eqx.tree_at(lambda c: (c.k, c.v), self, (k, v))
