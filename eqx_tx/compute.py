"""How a model is run (as opposed to what it is): attention kernel, remat policy.

A `ComputeConfig` is a frozen, hashable value passed as a static argument to every
function that runs a model; the model pytree itself holds only parameters.
"""

import dataclasses
from typing import Literal

import jax

from .layers.sdpa import IMPLEMENTATIONS, Implementation

RematPolicy = Literal["none", "full", "dots", "names"]

# Tensors tagged with `jax.ad_checkpoint.checkpoint_name` inside a decoder block,
# available to `remat="names"`.
CHECKPOINT_NAMES = ("q", "k", "v", "attention", "mlp_hidden", "block_attn_out")


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """Execution options shared by forward, training and generation.

    **Arguments:**

    - `attention`: `"auto"` (default), `"cudnn"`, `"blockwise"` or `"xla"`
      (see `eqx_tx.layers.sdpa`).
    - `block_q`, `block_kv`: tile sizes of the blockwise kernel.
    - `remat`: what each scanned layer keeps for the backward pass:
      `"full"` (default) keeps only the layer-boundary activations and recomputes
      the layer; `"none"` keeps everything; `"dots"` keeps matmul outputs without
      batch dimensions; `"names"` keeps the tensors named in `remat_names`.
    - `remat_names`: tensor names for `remat="names"`, from `CHECKPOINT_NAMES`.
    - `sequence_parallel`: shard activations between blocks over the sequence on
      the `tp` axis (Megatron-style sequence parallelism).
    """

    attention: Implementation = "auto"
    block_q: int = 512
    block_kv: int = 512
    remat: RematPolicy = "full"
    remat_names: tuple[str, ...] = ()
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}; choose from {IMPLEMENTATIONS}")
        if self.remat not in ("none", "full", "dots", "names"):
            raise ValueError(f"remat={self.remat!r}; choose from none, full, dots, names")
        unknown = set(self.remat_names) - set(CHECKPOINT_NAMES)
        if unknown:
            raise ValueError(f"remat_names {sorted(unknown)} unknown; choose from {CHECKPOINT_NAMES}")
        if self.block_q < 1 or self.block_kv < 1:
            raise ValueError(f"block sizes must be positive, got {self.block_q}, {self.block_kv}")

    def checkpoint_policy(self):
        """The `jax.checkpoint` policy for one scanned layer (`None`: recompute all)."""
        if self.remat == "dots":
            return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if self.remat == "names":
            return jax.checkpoint_policies.save_only_these_names(*self.remat_names)
        return None
