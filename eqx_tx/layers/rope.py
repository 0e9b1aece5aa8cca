"""Rotary position embeddings with Hugging Face's frequency scalings.

`RopeConfig` mirrors HF's `rope_parameters` (or the older `rope_scaling`) and
computes what `transformers.modeling_rope_utils` computes, in float32:

- `default`, `linear` (positions divided by `factor`), `llama3` (per-band smoothing);
- `yarn`: interpolation/extrapolation blend over a linear ramp between the
  correction dimensions of `beta_fast`/`beta_slow`, cos/sin scaled by the
  attention factor (`0.1 ln(factor) + 1` unless `attention_factor` or
  `mscale`/`mscale_all_dim` are given);
- `dynamic` (NTK): the base is rescaled when the sequence passes
  `max_position_embeddings`;
- `longrope`: per-frequency `short_factor` / `long_factor`, the long set once the
  sequence passes `original_max_position_embeddings`, cos/sin scaled.

`dynamic` and `longrope` depend on the sequence length of the call, `seq_len` of
`rope_cos_sin`: the longest real sequence (`max(position) + 1`), as HF takes
`max(position_ids) + 1`. HF's dynamic frequencies also depend on earlier calls (they
only grow while above `max_position_embeddings`); ours depend on the call alone,
which equals HF's for a fresh model, a whole forward pass, and one generation.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..core.log import log_once

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

# The keys each type reads from `rope_parameters` (besides rope_type/type, rope_theta).
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"),
}
_IGNORED = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How rotary frequencies are computed; mirrors HF `rope_parameters`/`rope_scaling`.

    Optional fields are `None` when the checkpoint does not set them (HF's defaults
    apply), so `to_hf` writes back exactly what was read.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    # longrope
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # The model's `max_position_embeddings` (dynamic scaling starts past it; yarn and
    # longrope derive `factor` from it when `factor` is absent).
    max_position_embeddings: int | None = None

    def __post_init__(self):
        t = self.rope_type
        if t not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {t!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if t in ("linear", "dynamic", "llama3") and self.factor is None:
            raise ValueError(f"{t} rope scaling needs 'factor'")
        if t in ("llama3", "yarn", "longrope") and self.original_max_position_embeddings is None:
            raise ValueError(f"{t} rope scaling needs original_max_position_embeddings")
        if t == "dynamic" and self.max_position_embeddings is None:
            raise ValueError("dynamic rope scaling needs max_position_embeddings (where scaling starts)")
        if t in ("yarn", "longrope") and self.factor is None and self.max_position_embeddings is None:
            raise ValueError(f"{t} rope scaling needs 'factor' (or max_position_embeddings to derive it)")
        if self.factor is not None and not self.factor >= 1.0 and t != "default":
            raise ValueError(f"rope scaling factor must be >= 1, got {self.factor}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope attention_factor must be > 0, got {self.attention_factor}")
        if t == "yarn" and (self.beta_fast or 32) < (self.beta_slow or 1):
            raise ValueError(
                f"yarn beta_fast ({self.beta_fast or 32}) must be >= beta_slow ({self.beta_slow or 1})"
            )
        if t == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})"
            )
        if t == "longrope":
            if self.short_factor is None or self.long_factor is None:
                raise ValueError("longrope rope scaling needs short_factor and long_factor")
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(
                    f"longrope short_factor ({len(self.short_factor)}) and long_factor ({len(self.long_factor)}) "
                    "differ in length"
                )

    @classmethod
    def from_hf(cls, hf: dict) -> "RopeConfig":
        """Read RoPE settings from a HF `config.json` dict (transformers 4.x or 5.x layout).

        Every field the type uses is read; an inconsistent one raises `ValueError`
        naming it, and keys the type does not use are logged and ignored.
        """
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        where = f"rope_scaling={hf.get('rope_scaling')!r}, rope_parameters={hf.get('rope_parameters')!r}"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"config.json: unsupported rope scaling type {rope_type!r} ({where}); "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        keys = _KEYS[rope_type]
        unused = sorted(set(merged) - set(keys) - _IGNORED)
        if unused:
            log_once(f"config.json: rope type {rope_type!r} ignores {', '.join(unused)}")
        fields = {k: merged[k] for k in keys if merged.get(k) is not None}
        if "original_max_position_embeddings" in keys and "original_max_position_embeddings" not in fields:
            # As HF: the top-level field (Phi-3), else max_position_embeddings.
            fallback = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
            if fallback is not None:
                fields["original_max_position_embeddings"] = fallback
        for k in ("short_factor", "long_factor"):
            if k in fields:
                fields[k] = tuple(float(x) for x in fields[k])
        if rope_type == "dynamic" or (rope_type in ("yarn", "longrope") and "factor" not in fields):
            fields["max_position_embeddings"] = hf.get("max_position_embeddings")
        try:
            return cls(theta=float(theta), rope_type=rope_type, **fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"config.json: {e} ({where})") from None

    def to_hf(self) -> dict:
        """The `rope_parameters` dict (transformers 5.x) for `config.json`."""
        out: dict = {"rope_type": self.rope_type, "rope_theta": self.theta}
        for k in _KEYS[self.rope_type]:
            value = getattr(self, k)
            if value is not None:
                out[k] = list(value) if isinstance(value, tuple) else value
        return out

    def _factor(self) -> float:
        if self.factor is not None:
            return self.factor
        assert self.max_position_embeddings is not None and self.original_max_position_embeddings is not None
        return self.max_position_embeddings / self.original_max_position_embeddings

    def attention_scaling(self) -> float:
        """The factor HF multiplies cos and sin by (1 except yarn and longrope)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn":
            factor = self._factor()

            def mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if self.mscale and self.mscale_all_dim:
                return float(mscale(factor, self.mscale) / mscale(factor, self.mscale_all_dim))
            return mscale(factor)
        if self.rope_type == "longrope":
            factor = self._factor()
            if factor <= 1.0:
                return 1.0
            assert self.original_max_position_embeddings is not None
            return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    def _exponent(self, head_dim: int) -> np.ndarray:
        return np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The `head_dim / 2` inverse frequencies, float32, computed as HF computes them.

        For `dynamic` these are the unscaled ones (a sequence within
        `max_position_embeddings`) and for `longrope` the short ones; the
        length-dependent sets come from `rope_cos_sin`.
        """
        exponent = self._exponent(head_dim)
        pos_freqs = (np.float32(self.theta) ** exponent).astype(np.float32)
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.rope_type == "linear":
            assert self.factor is not None
            inv = inv / np.float32(self.factor)
        elif self.rope_type == "llama3":
            inv = self._llama3(inv)
        elif self.rope_type == "yarn":
            inv = self._yarn(pos_freqs, head_dim)
        elif self.rope_type == "longrope":
            inv = self._longrope(head_dim, long=False)
        return inv.astype(np.float32)

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        old = self.original_max_position_embeddings
        assert old is not None and self.factor is not None  # checked in __post_init__
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled)

    def _yarn(self, pos_freqs: np.ndarray, head_dim: int) -> np.ndarray:
        factor = self._factor()
        original = self.original_max_position_embeddings
        assert original is not None
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(rotations):
            return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate is None or self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as HF: no zero-width ramp
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation = 1 - ramp
        inv_extrapolation = np.float32(1.0) / pos_freqs
        inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        return inv_interpolation * (1 - extrapolation) + inv_extrapolation * extrapolation

    def _longrope(self, head_dim: int, *, long: bool) -> np.ndarray:
        factors = self.long_factor if long else self.short_factor
        assert factors is not None
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries, "
                             f"head_dim {head_dim} needs {head_dim // 2}")
        ext = np.asarray(factors, np.float32)
        return np.float32(1.0) / (ext * np.float32(self.theta) ** self._exponent(head_dim))

    @property
    def extends_past_max_position(self) -> bool:
        """Whether sequences may run past `max_position_embeddings` (dynamic scaling
        exists for that: the frequencies stretch with the sequence)."""
        return self.rope_type == "dynamic"

    @property
    def depends_on_length(self) -> bool:
        """Whether the frequencies depend on the sequence length of the call."""
        return self.rope_type in ("dynamic", "longrope")

    def inv_freq_for(self, head_dim: int, seq_len: Int[Array, ""]) -> Float[Array, " half"]:
        """The inverse frequencies for a call whose longest sequence is `seq_len` (traced)."""
        if self.rope_type == "longrope":
            assert self.original_max_position_embeddings is not None
            long = jnp.asarray(self._longrope(head_dim, long=True))
            return jnp.where(seq_len > self.original_max_position_embeddings, long, jnp.asarray(self.inv_freq(head_dim)))
        if self.rope_type == "dynamic":
            assert self.factor is not None and self.max_position_embeddings is not None
            length = jnp.maximum(seq_len, self.max_position_embeddings).astype(jnp.float32)
            growth = jnp.float32(self.factor) * length / self.max_position_embeddings - (self.factor - 1)
            base = jnp.float32(self.theta) * growth ** jnp.float32(head_dim / (head_dim - 2))
            return 1.0 / base ** jnp.asarray(self._exponent(head_dim))
        return jnp.asarray(self.inv_freq(head_dim))


def rope_cos_sin(
    positions: Int[Array, "*batch seq"],
    head_dim: int,
    rope: RopeConfig,
    seq_len: Int[Array, ""] | None = None,
) -> tuple[Float[Array, "*batch seq head_dim"], Float[Array, "*batch seq head_dim"]]:
    """Cosines and sines for `positions`, float32, `[..., head_dim]` (halves repeated),
    scaled by the type's attention factor.

    `seq_len`: the longest real sequence of the call (`dynamic` and `longrope` only;
    default `max(positions) + 1`).
    """
    if rope.depends_on_length:
        if seq_len is None:
            seq_len = jnp.max(positions) + 1
        inv = rope.inv_freq_for(head_dim, seq_len)
    else:
        inv = jnp.asarray(rope.inv_freq(head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    scale = rope.attention_scaling()
    if scale == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


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
