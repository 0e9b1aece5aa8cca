"""How the caches store keys and values: as is, or int8 with a float32 scale per vector.

`KVStorage` declares the fields `k, v, k_scale, v_scale` (scales `None` unless int8)
that `KVCache` and `PagedKVCache` hold; `zero_kv` and `store_kv` create and write
them the same way for both.

Keys/values are `[..., tokens, kv_heads, head_dim]`; their scales are stored
tokens-minor, `[..., kv_heads, tokens]`: what the TPU decode kernel reads, a
`[kv_heads, block]` tile per block of tokens (`eqx_tx.kernels.decode_tpu`).
`KVStorage.pair` hands them out as `Quantized` (`[..., tokens, kv_heads]`) all the
same.
"""

from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from ..kernels.quantized import Quantized


class KVStorage(eqx.Module):
    """Keys and values, and their float32 scales when stored as int8 (else `None`)."""

    k: eqx.AbstractVar[Array]
    v: eqx.AbstractVar[Array]
    k_scale: eqx.AbstractVar[Array | None]
    v_scale: eqx.AbstractVar[Array | None]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def scales(self) -> tuple[Array, Array] | None:
        """The key and value scales as stored (tokens-minor), or `None` unless int8."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale, self.v_scale

    def pair(self, pick: Callable[[Array], Array]) -> tuple[Array | Quantized, Array | Quantized]:
        """`pick` applied to the keys and to the values (as `Quantized` pairs with their
        scales for int8; `pick` sees the scales tokens-minor and they come back
        `[..., tokens, kv_heads]`)."""
        if self.scales is not None:
            k_scale, v_scale = self.scales
            return (Quantized(pick(self.k), jnp.swapaxes(pick(k_scale), -1, -2)),
                    Quantized(pick(self.v), jnp.swapaxes(pick(v_scale), -1, -2)))
        return pick(self.k), pick(self.v)


C = TypeVar("C", bound=KVStorage)


def zero_kv(shape: tuple[int, ...], dtype) -> tuple[Array, Array, Array | None, Array | None]:
    """Zero `k, v` of `shape` `[..., tokens, kv_heads, head_dim]` (and, for int8, zero
    scales `[..., kv_heads, tokens]`)."""
    if jnp.dtype(dtype) == jnp.int8:
        scale = jnp.zeros((*shape[:-3], shape[-2], shape[-3]), jnp.float32)
        return jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scale, scale
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, None


def store_kv(cache: C, put: Callable[[Array, Array], Array], put_scale: Callable[[Array, Array], Array],
             k_new: Array, v_new: Array) -> C:
    """`cache` with `put(buffer, new)` applied to its keys and values (quantized first
    for an int8 cache, and `put_scale(scales, new [..., tokens, kv_heads])` to their
    tokens-minor scales)."""
    if cache.scales is not None:
        kq, vq = Quantized.quantize(k_new), Quantized.quantize(v_new)
        k_scale, v_scale = cache.scales
        new = (put(cache.k, kq.values), put(cache.v, vq.values), put_scale(k_scale, kq.scale),
               put_scale(v_scale, vq.scale))
        return eqx.tree_at(lambda c: (c.k, c.v, c.k_scale, c.v_scale), cache, new)
    new = (put(cache.k, k_new), put(cache.v, v_new))
    return eqx.tree_at(lambda c: (c.k, c.v), cache, new)
