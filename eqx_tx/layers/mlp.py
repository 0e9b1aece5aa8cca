"""The gated (SwiGLU) feed-forward block."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from ..core.sharding import constrain
from .linear import Linear


class GatedMLP(eqx.Module):
    """`down(silu(gate(x)) * up(x))`."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias=False, dtype=jnp.float32, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = Linear(hidden_size, intermediate_size, axes=("mlp", "embed"), use_bias=use_bias, dtype=dtype, key=kg)
        self.up_proj = Linear(hidden_size, intermediate_size, axes=("mlp", "embed"), use_bias=use_bias, dtype=dtype, key=ku)
        self.down_proj = Linear(intermediate_size, hidden_size, axes=("embed", "mlp"), use_bias=use_bias, dtype=dtype, key=kd)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        h_btf = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        h_btf = checkpoint_name(constrain(h_btf, ("batch", "seq", "act_mlp")), "mlp_hidden")
        return self.down_proj(h_btf)
