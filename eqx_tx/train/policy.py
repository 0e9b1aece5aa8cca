"""Policy-gradient losses for RL post-training (GRPO and relatives).

Every loss is a function of per-token log-probabilities of the current policy,
which come from the chunked LM head (`eqx_tx.train.loss`): its custom VJP turns the
gradient with respect to each token's log-probability (and entropy) into the head
and hidden-state gradients chunk by chunk, so no `[batch, seq, vocab]` logits exist
in the forward or the backward pass.

Per token `t`, with `r = exp(logp - sampler_logp)` and advantage `A`:

- `is` (importance sampling): `-r * A`.
- `ppo` (PPO-clip, with DAPO's separate `clip_low` / `clip_high`):
  `-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`.
- `cispo` (MiniMax-M1): `-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp`; the
  clipped weight carries no gradient, so no token's gradient is dropped.
- `gspo` (Qwen's GSPO, token form): the PPO-clip objective with the sequence-level
  ratio `s = exp(mean over the sequence of (logp - sampler_logp))`, as
  `sg(s) * exp(logp - sg(logp))` per token so each token's gradient is `s * A *
  grad logp`; with a per-sequence advantage and `normalise="sequence"` it is GSPO.

plus `kl_coef * k3` (Schulman's `k3 = exp(ref - logp) - (ref - logp) - 1`, an
unbiased, non-negative estimate of KL(policy || reference)) and `-entropy_coef *
entropy`. The per-token losses `l` are combined with the loss weights `w` by
`normalise`:

- `"token"` (DAPO's token-level mean): `sum(w * l) / sum(w)` over the batch.
- `"sequence"` (GRPO's): the mean over sequences of each sequence's
  `sum(w * l) / sum(w)`.
- `"group"`: the mean over groups (`Batch.group_ids`) of each group's
  `sum(w * l) / sum(w)`: every prompt weighs the same, whatever its answers' lengths.
- a number `C` (Dr. GRPO's constant): `sum(w * l) / C`, e.g. the batch's sequence
  count times the generation budget, so no token's weight depends on lengths.

Sequences are the rows of the batch, or the packed documents of a row
(`Batch.segment_ids`).
"""

import dataclasses
from typing import Literal, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..core.util import concrete_value
from ..models import CausalLM
from .batch import Batch
from .loss import DEFAULT_CHUNK_SIZE, sequence_logprobs

PolicyLossKind = Literal["ppo", "is", "cispo", "gspo"]
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLossKind)
Normalise = Literal["token", "sequence", "group"]
NORMALISATIONS: tuple[str, ...] = get_args(Normalise)


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy-gradient objective (see the module docstring for the formulas)."""

    loss: PolicyLossKind = "ppo"
    """`ppo`, `is` (importance sampling), `cispo` or `gspo`."""
    clip_low: float = 0.2
    """Ratios are clipped below at `1 - clip_low` (ppo, cispo, gspo)."""
    clip_high: float = 0.2
    """Ratios are clipped above at `1 + clip_high` (DAPO's clip-higher: set it larger)."""
    normalise: Normalise | float = "token"
    """`token`, `sequence`, `group`, or a constant divisor (Dr. GRPO)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to `Batch.reference_logprobs` (0: none)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0: entropy not computed)."""

    def __post_init__(self):
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {self.loss!r}; choose from {POLICY_LOSSES}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low and clip_high must be >= 0, got {self.clip_low}, {self.clip_high}")
        if isinstance(self.normalise, str):
            if self.normalise not in NORMALISATIONS:
                raise ValueError(f"unknown normalise {self.normalise!r}; choose from {NORMALISATIONS} or a number > 0")
        elif not self.normalise > 0:
            raise ValueError(f"a constant normaliser must be > 0, got {self.normalise}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0

    def check_batch(self, batch: Batch) -> None:
        """Raise if `batch` lacks (or has wrongly shaped) inputs this loss reads."""
        shape = tuple(batch.input_ids.shape)
        needed = {"sampler_logprobs": batch.sampler_logprobs, "advantages": batch.advantages}
        if self.kl_coef:
            needed["reference_logprobs"] = batch.reference_logprobs
        if self.normalise == "group":
            needed["group_ids"] = batch.group_ids
        for name, x in needed.items():
            if x is None:
                raise ValueError(f"the {self.loss!r} policy loss needs Batch.{name} (kl_coef={self.kl_coef}, "
                                 f"normalise={self.normalise!r})")
            if tuple(x.shape) != shape:
                raise ValueError(f"Batch.{name} has shape {tuple(x.shape)}, expected {shape} like input_ids")
        groups = concrete_value(batch.group_ids) if self.normalise == "group" else None
        if groups is not None and groups.size and (groups.min() < 0 or groups.max() >= groups.size):
            raise ValueError(f"Batch.group_ids must lie in [0, batch * seq = {groups.size}), "
                             f"got [{groups.min()}, {groups.max()}]")


def _per_sequence(x, ids, num: int):
    """Each token's sum of `x` over the tokens sharing its id."""
    return jax.ops.segment_sum(x.reshape(-1), ids.reshape(-1), num)[ids]


def _sequence_ids(batch: Batch) -> tuple[Int[Array, "batch seq"], int]:
    """A distinct id per sequence: the row, or (row, packed document); and how many ids may occur."""
    B, T = batch.input_ids.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    if batch.segment_ids is None:
        return rows, B
    return rows * (T + 1) + jnp.asarray(batch.segment_ids), B * (T + 1)


def token_coefficients(batch: Batch, normalise: Normalise | float) -> Float[Array, "batch seq"]:
    """`c` such that the batch's loss is `sum(c * l)` for per-token losses `l`.

    Computed once over the whole batch, so micro-batches' shares add up to it.
    """
    w = jnp.asarray(batch.loss_weights, jnp.float32)
    if not isinstance(normalise, str):
        return w / normalise
    if normalise == "token":
        total = jnp.sum(w)
        return jnp.where(total != 0, w / jnp.where(total != 0, total, 1.0), 0.0)
    if normalise == "sequence":
        ids, num = _sequence_ids(batch)
    else:
        assert batch.group_ids is not None, "normalise='group' needs Batch.group_ids"
        B, T = w.shape
        ids, num = jnp.asarray(batch.group_ids), B * T
    totals = _per_sequence(w, ids, num)
    members = jax.ops.segment_sum((w != 0).astype(jnp.int32).reshape(-1), ids.reshape(-1), num)
    count = jnp.maximum(jnp.sum(members > 0), 1)
    return jnp.where(totals != 0, w / jnp.where(totals != 0, totals, 1.0), 0.0) / count


def policy_objective(
    logprobs: Float[Array, "batch seq"],
    entropy: Float[Array, "batch seq"] | None,
    batch: Batch,
    coefficients: Float[Array, "batch seq"],
    count: Float[Array, ""],
    config: PolicyLoss,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The loss of `batch` (or of a micro-batch: its share) from the current log-probs.

    **Arguments:**

    - `logprobs`, `entropy`: the current policy's, per token (entropy only if
      `config.entropy_coef`).
    - `batch`: the (micro-)batch, with the inputs `config.check_batch` asks for.
    - `coefficients`: `token_coefficients` of the whole batch, this micro-batch's rows.
    - `count`: the whole batch's number of tokens with a non-zero weight; the
      metrics are token means over them.
    - `config`: the objective.

    **Returns:** the loss and metrics (this micro-batch's shares: they add up over
    micro-batches): `policy_loss` (the clipped surrogate alone), `ratio`,
    `clip_fraction` (tokens whose ratio is outside the clip range), `sampler_kl`
    (k3 estimate of KL(sampler || policy)), and `kl`, `entropy` where computed.
    """
    assert batch.sampler_logprobs is not None and batch.advantages is not None
    mask = (jnp.asarray(batch.loss_weights) != 0).astype(jnp.float32)
    old = jnp.asarray(batch.sampler_logprobs, jnp.float32)
    adv = jnp.where(mask != 0, jnp.asarray(batch.advantages, jnp.float32), 0.0)
    lo, hi = 1.0 - config.clip_low, 1.0 + config.clip_high
    log_ratio = jnp.where(mask != 0, logprobs - old, 0.0)  # padding may hold anything
    ratio = jnp.exp(log_ratio)
    if config.loss == "gspo":
        ids, num = _sequence_ids(batch)
        seq_log_ratio = _per_sequence(log_ratio * mask, ids, num) / jnp.maximum(_per_sequence(mask, ids, num), 1.0)
        ratio = jax.lax.stop_gradient(jnp.exp(seq_log_ratio)) * jnp.exp(logprobs - jax.lax.stop_gradient(logprobs))
    clipped = jnp.clip(ratio, lo, hi)
    if config.loss == "is":
        token_loss = -ratio * adv
    elif config.loss == "cispo":
        token_loss = -jax.lax.stop_gradient(clipped) * adv * logprobs
    else:  # ppo, gspo
        token_loss = -jnp.minimum(ratio * adv, clipped * adv)

    def mean(x):  # token mean over the whole batch (this micro-batch's share)
        return jnp.sum(mask * jax.lax.stop_gradient(x)) / count

    metrics = {
        "policy_loss": jnp.sum(coefficients * jax.lax.stop_gradient(token_loss)),
        "ratio": mean(ratio),
        "clip_fraction": mean((ratio < lo) | (ratio > hi)) if config.loss != "is" else jnp.zeros(()),
        "sampler_kl": mean(ratio - 1.0 - log_ratio),
    }
    if config.kl_coef:
        assert batch.reference_logprobs is not None
        ref_log_ratio = jnp.where(mask != 0, jnp.asarray(batch.reference_logprobs, jnp.float32) - logprobs, 0.0)
        k3 = jnp.exp(ref_log_ratio) - ref_log_ratio - 1.0
        token_loss = token_loss + config.kl_coef * k3
        metrics["kl"] = mean(k3)
    if config.entropy_coef:
        assert entropy is not None, "entropy_coef needs the per-token entropy"
        token_loss = token_loss - config.entropy_coef * entropy
        metrics["entropy"] = mean(entropy)
    return jnp.sum(coefficients * token_loss), metrics


def nonzero_count(weights) -> Float[Array, ""]:
    """The number of tokens with a non-zero loss weight (at least 1), float32."""
    return jnp.maximum(jnp.sum(jnp.asarray(weights) != 0), 1).astype(jnp.float32)


def policy_loss(
    model: CausalLM,
    batch: Batch,
    config: PolicyLoss = PolicyLoss(),
    *,
    reference_logprobs: Float[Array, "batch seq"] | None = None,
    compute: ComputeConfig = ComputeConfig(),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """A policy-gradient loss of `model` on sampled tokens, through the chunked LM head.

    Differentiable with respect to `model` (e.g. under `eqx.filter_value_and_grad`
    with `has_aux=True`); `train_step` computes the same with `TrainConfig.policy_loss`.

    **Arguments:**

    - `model`: the policy.
    - `batch`: sampled sequences with `sampler_logprobs` and `advantages` (and
      `group_ids` for `normalise="group"`); `loss_weights` masks the prompt and
      padding (or weighs tokens).
    - `config`: the objective (`PolicyLoss`: loss, clips, normalisation, KL and
      entropy weights; the formulas in this module's docstring).
    - `reference_logprobs`: the reference policy's log-probs for the KL penalty
      (default: `batch.reference_logprobs`).
    - `compute`, `chunk_size`: how the model runs; tokens per LM-head chunk.

    **Returns:** the loss and the metrics of `policy_objective`.
    """
    if reference_logprobs is not None:
        batch = eqx.tree_at(lambda b: b.reference_logprobs, batch, reference_logprobs,
                            is_leaf=lambda x: x is None)
    config.check_batch(batch)
    segments = None if batch.segment_ids is None else jnp.asarray(batch.segment_ids)
    scores = sequence_logprobs(model, *(jnp.asarray(x) for x in (batch.input_ids, batch.target_ids, batch.lengths)),
                               compute=compute, chunk_size=chunk_size, segment_ids=segments,
                               entropy=config.needs_entropy)
    coefficients = token_coefficients(batch, config.normalise)
    return policy_objective(scores.logprobs, scores.entropy, batch, coefficients,
                            nonzero_count(batch.loss_weights), config)
