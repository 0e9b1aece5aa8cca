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
    """

    input_ids: Int[HostOrDevice, "batch seq"]
    target_ids: Int[HostOrDevice, "batch seq"]
    loss_weights: Float[HostOrDevice, "batch seq"]
    lengths: Int[HostOrDevice, " batch"]
    segment_ids: Int[HostOrDevice, "batch seq"] | None = None
