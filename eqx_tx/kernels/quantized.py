"""How KV caches store keys/values besides as is: int8 vectors with one float32 scale
each (`Quantized`), and bf16 as its uint16 bit patterns (`BITS`, on XLA:CPU:
`eqx_tx.cache.storage` says why)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8

BITS = jnp.uint16  # bf16 keys/values stored as their bit patterns


def as_values(x: Array) -> Array:
    """Stored keys/values as their values (`BITS` viewed as bf16; else as they are)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BITS else x


class Quantized(eqx.Module):
    """int8 `values [..., head_dim]` with a float32 `scale [...]` per vector:
    `x ≈ values * scale`, `scale = max|x| / 127` over the last axis."""

    values: Int8[Array, "*rows head_dim"]
    scale: Float[Array, "*rows"]

    @classmethod
    def quantize(cls, x: Float[Array, "*rows head_dim"]) -> "Quantized":
        x = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
        q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
        return cls(jnp.clip(q, -127, 127).astype(jnp.int8), scale)

    def dequantize(self, dtype) -> Float[Array, "*rows head_dim"]:
        return (self.values.astype(jnp.float32) * self.scale[..., None]).astype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape
