"""The training batch: what the data path produces and `train_step` consumes."""

import dataclasses

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float, Int

HostOrDevice = Array | np.ndarray  # numpy on the host (the data path), jax arrays on devices
PER_TOKEN = "per_token"


def per_token(default=None):
    """A `Batch` field of one value per token (`[batch, seq]`): packing by token budget
    (`eqx_tx.train.token_budget`) moves it along with its sequence's tokens."""
    return eqx.field(default=default, metadata={PER_TOKEN: True})


class Batch(eqx.Module):
    """A training batch of right-padded sequences.

    `loss_weights` is a 0/1 mask or real-valued per-token weights; the loss is
    `-sum(weights * logp(target)) / (number of non-zero weights)` over the batch.

    `segment_ids` (optional) packs several documents per row: `1..k` in order along
    the row, `0` for the padding after `lengths`. Tokens attend only within their
    document and RoPE positions restart at 0 in each, so every document is scored
    as if it ran alone.

    The policy-gradient losses (`eqx_tx.policy_loss`, `TrainConfig.policy_loss`)
    also read, per token: `sampler_logprobs` (the log-probability of each target
    under the policy that sampled it), `advantages` (a per-sequence advantage is
    repeated over the sequence's tokens), optionally `reference_logprobs` (a
    reference policy's, for the KL penalty) and `group_ids` (which group of samples,
    e.g. of one prompt, each token belongs to: `0 <= id < batch * seq`; for
    `normalise="group"`).

    `adapter_ids` (for a model with a LoRA bank, `apply_lora(..., adapters=n)`) names
    each row's adapter. Each adapter's loss is normalised over its own rows, as if it
    trained alone; the step's loss is their sum.

    Fields of one value per token are declared with `per_token()`; `lengths`,
    `segment_ids` and `adapter_ids` describe the layout (rebuilt when sequences are
    packed). A subclass may add per-token fields of its own.
    """

    input_ids: Int[HostOrDevice, "batch seq"] = eqx.field(metadata={PER_TOKEN: True})
    target_ids: Int[HostOrDevice, "batch seq"] = eqx.field(metadata={PER_TOKEN: True})
    loss_weights: Float[HostOrDevice, "batch seq"] = eqx.field(metadata={PER_TOKEN: True})
    lengths: Int[HostOrDevice, " batch"]
    segment_ids: Int[HostOrDevice, "batch seq"] | None = None
    sampler_logprobs: Float[HostOrDevice, "batch seq"] | None = per_token()
    advantages: Float[HostOrDevice, "batch seq"] | None = per_token()
    reference_logprobs: Float[HostOrDevice, "batch seq"] | None = per_token()
    group_ids: Int[HostOrDevice, "batch seq"] | None = per_token()
    adapter_ids: Int[HostOrDevice, " batch"] | None = None

    @classmethod
    def per_token_fields(cls) -> tuple[str, ...]:
        """The names of the fields declared `per_token` (a subclass's included)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(PER_TOKEN))
