"""Rotary position embeddings (default, linear and Llama-3 frequency scaling)."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How rotary frequencies are computed; mirrors HF `rope_parameters`/`rope_scaling`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type == "llama3" and self.original_max_position_embeddings is None:
            raise ValueError("llama3 rope scaling needs original_max_position_embeddings")

    @classmethod
    def from_hf(cls, hf: dict) -> "RopeConfig":
        """Read RoPE settings from a HF `config.json` dict (transformers 4.x or 5.x layout)."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"config.json: unsupported rope scaling type {rope_type!r} "
                f"(rope_scaling={hf.get('rope_scaling')!r}, rope_parameters={hf.get('rope_parameters')!r}); "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            return cls(theta=float(theta))
        if rope_type == "linear":
            return cls(theta=float(theta), rope_type=rope_type, factor=float(merged["factor"]))
        return cls(  # llama3
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )

    def to_hf(self) -> dict:
        """The `rope_parameters` dict (transformers 5.x) for `config.json`."""
        out = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The `head_dim / 2` inverse frequencies, float32, computed as HF computes them."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (np.float32(1.0) / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.rope_type == "linear":
            inv = inv / np.float32(self.factor)
        elif self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            assert old is not None  # checked in __post_init__
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = np.float32(2 * math.pi) / inv
            scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


def rope_cos_sin(
    positions: Int[Array, "*batch seq"], head_dim: int, rope: RopeConfig
) -> tuple[Float[Array, "*batch seq head_dim"], Float[Array, "*batch seq head_dim"]]:
    """Cosines and sines for `positions`, float32, `[..., head_dim]` (halves repeated)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq(head_dim))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(
    x: Float[Array, "batch seq heads head_dim"],
    cos: Float[Array, "batch seq head_dim"],
    sin: Float[Array, "batch seq head_dim"],
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate `x` by its positions' angles (the rotate-half convention of HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
