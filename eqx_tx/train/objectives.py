"""The summed per-token objectives of the Tinker API's `forward_backward`.

Each datum carries, per position `t` (position `t` of the input predicts
`target_tokens[t]`), what its loss reads; the loss of a request is the **sum** over
its datums and positions (`loss:sum`), not a mean. With `logp` the current policy's
log-probability of the target, `q` the sampler's (`logprobs` input), `r = exp(logp -
q)` and `A` the advantage:

- `cross_entropy`: `-w * logp` (`weights`, default 1).
- `importance_sampling`: `-r * A`.
- `ppo`: `-min(r * A, clip(r, lo, hi) * A)`, `lo = clip_low_threshold` (0.8),
  `hi = clip_high_threshold` (1.2): thresholds on the ratio, not offsets from 1.
- `cispo`: `-sg(clip(r, lo, hi)) * logp * A`.
- `dro`: `-(logp * A - beta / 2 * (logp - q)^2)` (`beta`, default 0.05).

Positions past a datum's length (padding of the packed rows) contribute nothing. The
log-probabilities come from the chunked LM head (`eqx_tx.train.loss`): no
`[batch, seq, vocab]` logits exist in the forward or the backward pass.
"""

import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Objective = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)

CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}
"""Each objective's `loss_fn_config` keys and their defaults."""

INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    **{k: (("target_tokens", "logprobs", "advantages"), ()) for k in OBJECTIVES if k != "cross_entropy"},
}
"""Each objective's `loss_fn_inputs`: (required, optional)."""


def objective_config(kind: str, config: dict[str, float] | None) -> dict[str, float]:
    """`config` checked against `kind`'s keys and completed with the defaults.

    Raises `ValueError` naming an unknown objective or key, or a value out of range.
    """
    if kind not in OBJECTIVES:
        raise ValueError(f"unknown loss_fn {kind!r}; supported: {', '.join(OBJECTIVES)} "
                         "(and custom losses through forward_backward_custom)")
    defaults = CONFIG_DEFAULTS[kind]
    unknown = sorted(set(config or {}) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise ValueError(f"loss_fn_config key {unknown[0]!r} is not a setting of {kind!r} (its keys: {allowed})")
    out = {**defaults, **{k: float(v) for k, v in (config or {}).items()}}
    for k, v in out.items():
        if not math.isfinite(v):
            raise ValueError(f"loss_fn_config[{k!r}] must be finite, got {v}")
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= out["clip_high_threshold"]:
        raise ValueError("loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold, got "
                         f"{out['clip_low_threshold']} and {out['clip_high_threshold']}")
    if out.get("beta", 0.0) < 0:
        raise ValueError(f"loss_fn_config['beta'] must be >= 0, got {out['beta']}")
    return out


def token_losses(
    kind: str,
    logp: Float[Array, "batch seq"],
    mask: Float[Array, "batch seq"],
    weights: Float[Array, "batch seq"],
    sampler_logp: Float[Array, "batch seq"],
    advantages: Float[Array, "batch seq"],
    config: dict[str, Float[Array, ""]],
) -> Float[Array, "batch seq"]:
    """Each position's loss under objective `kind` (module docstring); 0 where `mask` is 0.

    **Arguments:** `logp` the current log-probabilities; `mask` 1 on a datum's
    positions; `weights`, `sampler_logp`, `advantages` the datum's inputs (whichever
    `kind` reads); `config` the completed `objective_config` (values may be traced).
    """
    live = mask != 0
    if kind == "cross_entropy":
        loss = -weights * logp
    else:
        log_ratio = jnp.where(live, logp - sampler_logp, 0.0)
        ratio = jnp.exp(log_ratio)
        if kind == "importance_sampling":
            loss = -ratio * advantages
        elif kind == "ppo":
            clipped = jnp.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
            loss = -jnp.minimum(ratio * advantages, clipped * advantages)
        elif kind == "cispo":
            clipped = jnp.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
            loss = -jax.lax.stop_gradient(clipped) * logp * advantages
        elif kind == "dro":
            loss = -(logp * advantages - 0.5 * config["beta"] * log_ratio**2)
        else:
            raise ValueError(f"unknown loss_fn {kind!r}")
    return jnp.where(live, loss, 0.0)
