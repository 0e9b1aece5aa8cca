"""The training batch: what the data path produces and `train_step` consumes."""

import equinox as eqx
from jaxtyping import Array, Float, Int


class Batch(eqx.Module):
    """A training batch of right-padded sequences.

    `loss_weights` is a 0/1 mask or real-valued per-token weights; the loss is
    `-sum(weights * logp(target)) / (number of non-zero weights)` over the batch.
    """

    input_ids: Int[Array, "batch seq"]
    target_ids: Int[Array, "batch seq"]
    loss_weights: Float[Array, "batch seq"]
    lengths: Int[Array, " batch"]
