"""How the caches store keys and values: as is, or int8 with a float32 scale per vector.

Both `KVCache` and `PagedKVCache` have the fields `k, v, k_scale, v_scale` (scales
`None` unless int8); these two helpers create and write them the same way.
"""

from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from ..kernels.quantized import Quantized

C = TypeVar("C", bound=eqx.Module)


def zero_kv(shape: tuple[int, ...], dtype) -> tuple[Array, Array, Array | None, Array | None]:
    """Zero `k, v` of `shape` (and, for int8, zero scales of `shape[:-1]`)."""
    if jnp.dtype(dtype) == jnp.int8:
        scale = jnp.zeros(shape[:-1], jnp.float32)
        return jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scale, scale
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, None


def store_kv(cache: C, put: Callable[[Array, Array], Array], k_new: Array, v_new: Array) -> C:
    """`cache` with `put(buffer, new)` applied to its keys and values (quantized first,
    scales alongside, for an int8 cache)."""
    if getattr(cache, "k_scale") is not None:
        kq, vq = Quantized.quantize(k_new), Quantized.quantize(v_new)
        new = (put(getattr(cache, "k"), kq.values), put(getattr(cache, "v"), vq.values),
               put(getattr(cache, "k_scale"), kq.scale), put(getattr(cache, "v_scale"), vq.scale))
        return eqx.tree_at(lambda c: (c.k, c.v, c.k_scale, c.v_scale), cache, new)
    new = (put(getattr(cache, "k"), k_new), put(getattr(cache, "v"), v_new))
    return eqx.tree_at(lambda c: (c.k, c.v), cache, new)
