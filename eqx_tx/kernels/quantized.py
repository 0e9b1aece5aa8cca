"""How KV caches store keys/values besides as is: int8 vectors with one float32 scale
each (`Quantized`), and bf16 as its uint16 bit patterns (`BITS`, on XLA:CPU:
`eqx_tx.cache.storage` says why); and how those scales are laid out.

**The scales' layout.** A cache of `tokens` positions and `kv_heads` heads stores its
scales `[..., groups, rows, lanes]`: the kv heads in `groups` (one per tensor-parallel
shard of them, so each device holds its own heads' scales), each group's scales
tokens-major with its `heads = kv_heads // groups` heads minor, `per_row = min(128 //
heads, tokens)` tokens to a row of `lanes = per_row * heads`: token `t`, head `h` of a
group at row `t // per_row`, lane `(t % per_row) * heads + h`. A row holds the scales of
128 consecutive score columns of the TPU decode kernel, which scores a block's rows
`[tokens * kv_heads]` token by token (`eqx_tx.kernels.decode_tpu`): each 128 columns
take one row of the tile, broadcast, where a heads-major `[kv_heads, tokens]` tile had
to be spread over them by a matmul every step (on a TPU v5e a minimal kernel applying
scales this way read int8 blocks at 70% of the bandwidth, the decode kernel spreading
them at 35-44%: `benchmarks/results/accelerator_tpu_v5e.md`, stop 54). A page of fewer
than `128 // heads` tokens is one short row (no padding).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8

from ..core.util import ceil_div

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


SCALE_LANES = 128  # the lanes of a TPU vector register: one row of a scale tile


def scale_shape(lead: tuple[int, ...], tokens: int, kv_heads: int, groups: int) -> tuple[int, ...]:
    """The scales' shape for keys/values `[*lead, tokens, kv_heads, head_dim]` stored in
    `groups` groups of kv heads (see the module's docstring)."""
    if kv_heads % groups or kv_heads // groups > SCALE_LANES:
        raise ValueError(f"{kv_heads} kv heads do not split into {groups} groups of at most {SCALE_LANES}")
    heads = kv_heads // groups
    per_row = min(SCALE_LANES // heads, tokens)
    return (*lead, groups, ceil_div(tokens, per_row), per_row * heads)


def scales_by_token(x: Float[Array, "*lead groups rows lanes"], tokens: int,
                    kv_heads: int) -> Float[Array, "*lead tokens kv_heads"]:
    """Stored scales as `[*lead, tokens, kv_heads]` (the layout of `Quantized.scale`)."""
    *lead, groups, rows, lanes = x.shape
    heads = kv_heads // groups
    x = x.reshape(*lead, groups, rows * (lanes // heads), heads)[..., :tokens, :]
    return jnp.moveaxis(x, -3, -2).reshape(*lead, tokens, kv_heads)


def stored_scales(x: Float[Array, "*lead tokens kv_heads"], groups: int = 1) -> Float[Array, "*lead groups rows lanes"]:
    """Scales `[*lead, tokens, kv_heads]` in the stored layout (`scales_by_token`'s
    inverse; a last row's unused lanes are zeros)."""
    *lead, tokens, kv_heads = x.shape
    *_, rows, lanes = scale_shape(tuple(lead), tokens, kv_heads, groups)
    heads = kv_heads // groups
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, rows * (lanes // heads) - tokens), (0, 0)])
    x = jnp.moveaxis(x.reshape(*lead, rows * (lanes // heads), groups, heads), -2, -3)
    return x.reshape(*lead, groups, rows, lanes)
