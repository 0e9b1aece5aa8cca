"""How the caches store keys and values: as is, or int8 with a float32 scale per vector.

`KVStorage` declares the fields `k, v, k_scale, v_scale` (scales `None` unless int8)
that `KVCache` and `PagedKVCache` hold; `zero_kv` and `store_kv` create and write
them the same way for both.

Keys/values are `[..., tokens, kv_heads, head_dim]`; their scales are stored
tokens-minor, `[..., kv_heads, tokens]`: what the TPU decode kernel reads, a
`[kv_heads, block]` tile per block of tokens (`eqx_tx.kernels.decode_tpu`).
`KVStorage.pair` hands them out as `Quantized` (`[..., tokens, kv_heads]`) all the
same.

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
from jaxtyping import Array

from ..kernels.quantized import BITS, Quantized, as_values


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
        """The key and value scales as stored (tokens-minor), or `None` unless int8."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale, self.v_scale

    def pair(self, pick: Callable[[Array], Array]) -> tuple[Array | Quantized, Array | Quantized]:
        """`pick` applied to the keys and to the values (as `Quantized` pairs with their
        scales for int8; `pick` sees the scales tokens-minor and they come back
        `[..., tokens, kv_heads]`; `BITS` come back as bf16)."""
        if self.scales is not None:
            k_scale, v_scale = self.scales
            return (Quantized(pick(self.k), jnp.swapaxes(pick(k_scale), -1, -2)),
                    Quantized(pick(self.v), jnp.swapaxes(pick(v_scale), -1, -2)))
        return as_values(pick(self.k)), as_values(pick(self.v))


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
    tokens-minor scales; as bf16 bit patterns into `BITS`)."""
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
