"""RMS normalisation."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..core.sharding import HasAxes


class RMSNorm(HasAxes):
    """`x / rms(x) * weight`, computed in float32 and cast back as Hugging Face does."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"weight": ("norm",)}

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.weight * x32.astype(x.dtype)
