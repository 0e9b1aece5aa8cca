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
- `gspo` (GSPO-token): the PPO objective with each token's ratio
  `s_t = sg(s) * exp(logp - sg(logp))`, where `s = exp(mean of (logp - q))` over the
  datum's tokens marked by `sequence_ratio_mask` (same thresholds and defaults as `ppo`).

Positions past a datum's length (padding of the packed rows) contribute nothing. The
log-probabilities come from the chunked LM head (`eqx_tx.train.loss`): no
`[batch, seq, vocab]` logits exist in the forward or the backward pass.
"""

import functools
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

Objective = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)

CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
"""Each objective's `loss_fn_config` keys and their defaults."""

INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    **{k: (("target_tokens", "logprobs", "advantages"), ()) for k in ("importance_sampling", "ppo", "cispo", "dro")},
    "gspo": (("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"), ()),
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
    *,
    ratio_mask: Float[Array, "batch seq"] | None = None,
    sequence_ids: Int[Array, "batch seq"] | None = None,
    num_sequences: int = 1,
) -> Float[Array, "batch seq"]:
    """Each position's loss under objective `kind` (module docstring); 0 where `mask` is 0.

    **Arguments:** `logp` the current log-probabilities; `mask` 1 on a datum's
    positions; `weights`, `sampler_logp`, `advantages` the datum's inputs (whichever
    `kind` reads); `config` the completed `objective_config` (values may be traced);
    for `gspo`, `ratio_mask` (the datum's `sequence_ratio_mask`) and `sequence_ids`,
    which datum each position belongs to (`0 <= id < num_sequences`; default: one).
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
        elif kind == "gspo":
            ids = jnp.zeros(logp.shape, jnp.int32) if sequence_ids is None else sequence_ids
            marked = jnp.where(live, jnp.ones_like(logp) if ratio_mask is None else (ratio_mask != 0), 0.0)
            per_sequence = functools.partial(_per_sequence, ids=ids, num=num_sequences)
            mean = per_sequence(jax.lax.stop_gradient(log_ratio) * marked) / jnp.maximum(per_sequence(marked), 1.0)
            ratio = jnp.exp(mean + logp - jax.lax.stop_gradient(logp))
            clipped = jnp.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
            loss = -jnp.minimum(ratio * advantages, clipped * advantages)
        else:
            raise ValueError(f"unknown loss_fn {kind!r}")
    return jnp.where(live, loss, 0.0)


def _per_sequence(x, *, ids, num: int):
    """Each position's sum of `x` over the positions of its sequence."""
    return jax.ops.segment_sum(x.reshape(-1), ids.reshape(-1), num)[ids]
