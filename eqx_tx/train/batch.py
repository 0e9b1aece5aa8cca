"""The training batch: what the data path produces and `train_step` consumes."""

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float, Int

HostOrDevice = Array | np.ndarray  # numpy on the host (the data path), jax arrays on devices


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
    """

    input_ids: Int[HostOrDevice, "batch seq"]
    target_ids: Int[HostOrDevice, "batch seq"]
    loss_weights: Float[HostOrDevice, "batch seq"]
    lengths: Int[HostOrDevice, " batch"]
    segment_ids: Int[HostOrDevice, "batch seq"] | None = None
    sampler_logprobs: Float[HostOrDevice, "batch seq"] | None = None
    advantages: Float[HostOrDevice, "batch seq"] | None = None
    reference_logprobs: Float[HostOrDevice, "batch seq"] | None = None
    group_ids: Int[HostOrDevice, "batch seq"] | None = None
    adapter_ids: Int[HostOrDevice, " batch"] | None = None
