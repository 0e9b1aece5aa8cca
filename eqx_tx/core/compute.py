"""How a model is run (as opposed to what it is): attention kernel, remat policy.

A `ComputeConfig` is a frozen, hashable value passed as a static argument to every
function that runs a model; the model pytree itself holds only parameters. This
module sits below the kernels (`eqx_tx.kernels.dispatch` reads it) and imports
nothing from the package.
"""

import dataclasses
from typing import Literal, get_args

import jax

AttentionImpl = Literal["auto", "cudnn", "splash", "decode_tpu", "blockwise", "xla"]
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttentionImpl)

DecodeLayers = Literal["auto", "scan", "unrolled"]
DECODE_LAYERS: tuple[str, ...] = get_args(DecodeLayers)

RematPolicy = Literal["none", "full", "dots", "names", "offload", "auto"]
REMAT_POLICIES: tuple[str, ...] = get_args(RematPolicy)

# Tensors tagged with `jax.ad_checkpoint.checkpoint_name` inside a decoder block,
# available to `remat="names"` (and kept on the device under `remat="offload"`).
CHECKPOINT_NAMES = ("q", "k", "v", "attention", "mlp_hidden", "block_attn_out")
# The name of each scanned layer's input (the saved carry), moved to host memory
# under `remat="offload"`.
LAYER_INPUT = "layer_input"


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """Execution options shared by forward, training and generation."""

    attention: AttentionImpl = "auto"
    """Attention kernel: `auto` (cuDNN where it can run, else for large score tiles
    splash where it can run and blockwise where not, else xla; logged once), `cudnn`
    (GPU), `splash` (JAX's Pallas TPU kernel: causal self-attention from position 0,
    as in training and prompt scoring), `decode_tpu` (eqx_tx's Pallas TPU kernel for
    one query per sequence over a bf16/fp32/int8 KV cache, read in place: decoding, with
    every other call as under `auto`; off a TPU it runs in Pallas's interpreter), `blockwise` (pure-JAX flash) or `xla`
    (materialised scores, the reference)."""
    block_q: int | None = None
    """Query tile size of the blockwise and splash kernels (`None`: the platform's
    default, `eqx_tx.kernels.dispatch.DEFAULT_BLOCKS`)."""
    block_kv: int | None = None
    """Key/value tile size of the blockwise and splash kernels (`None`: the platform's
    default)."""
    remat: RematPolicy = "full"
    """What each scanned layer keeps for the backward pass: `full` keeps only the
    layer-boundary activations and recomputes the layer, `none` keeps everything,
    `dots` keeps matmul outputs without batch dimensions, `names` keeps the tensors
    named in `remat_names`, `offload` is `full` with the layer-boundary activations
    moved to pinned host memory during the forward pass and brought back for the
    backward (plus `remat_names` kept on the device), `auto` the fastest of these
    that fits a memory budget (`eqx_tx.train.remat_auto`; `train_step` resolves it)."""
    remat_names: tuple[str, ...] = ()
    """Tensor names kept under `remat=names` (and on the device under `offload`):
    q, k, v, attention, mlp_hidden, block_attn_out."""
    memory_budget_gib: float | None = None
    """Per-device memory `remat="auto"` must fit in (`None`: the device's allocator
    limit, 0.75 of its memory by JAX's default)."""
    sequence_parallel: bool = False
    """Shard the activations between blocks over the sequence on the `tp` axis
    (Megatron-style sequence parallelism)."""
    decode_layers: DecodeLayers = "auto"
    """How `generate`'s decode loop runs the layer stack: `scan` (one scanned layer;
    every step slices each layer's weights out of the stacked arrays), `unrolled` (the
    weights are sliced into per-layer buffers once per decode call, before its token
    loop, and each step runs the layers one after another: one more copy of the layer
    weights while decoding, and a step that compiles once per layer), or `auto`
    (unrolled on a TPU, and on CPU at batch > 1; scan otherwise; logged once).
    Scanned, XLA:CPU copies each layer's weights out of the stack for every matmul of
    more than one row, on every step; at batch 1 the projections are matrix-vector
    products that read the stack in place. On a TPU v5e (Qwen3-0.6B shape, bf16,
    `benchmarks/results/accelerator_tpu_v5e.md`) unrolled decodes at 1.68 ms a step
    at batch 1 (88% of the data-sheet bandwidth roofline) against 2.23 ms scanned,
    and 3.08 against 3.50 ms at batch 16. XLA:GPU reads the stack in place."""

    decode_tokens_per_step: int = 512
    """Tokens of one sequence's bf16 or float32 cache that the TPU decode kernel
    (`decode_tpu`) reads per grid step: that many tokens' blocks (whole cache blocks
    or pages, at least one), each its own DMA. A grid step has a fixed cost, which
    fewer, larger steps share: on a TPU v5e (Qwen3-0.6B shape, pages of 128) 512
    against 128 took a 1k x 64 step's attention from 14.5 to 13.4 ms and a 4k x 32
    one's from 25.7 to 22.1 (`benchmarks/results/accelerator_tpu_v5e.md`)."""

    decode_int8_tokens_per_step: int = 512
    """`decode_tokens_per_step` for an int8 cache. Its blocks are bound by their
    compute, not their DMAs, so above one block per step the kernel folds a step's
    blocks as one. On a TPU v5e (`generate`, Qwen3-0.6B
    shape, `benchmarks/results/accelerator_tpu_v5e.md`) 512 against 128 took a 4k x 32
    step from 29.8 to 25.8 ms and an 8k x 16 one from 29.4 to 24.5; at 1k x 64 it cost
    4% (18.4 against 17.7)."""

    def __post_init__(self):
        for name in ("decode_tokens_per_step", "decode_int8_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attention implementation {self.attention!r}; choose from {ATTENTION_IMPLEMENTATIONS}"
            )
        if self.decode_layers not in DECODE_LAYERS:
            raise ValueError(f"decode_layers={self.decode_layers!r}; choose from {', '.join(DECODE_LAYERS)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose from {', '.join(REMAT_POLICIES)}")
        unknown = set(self.remat_names) - set(CHECKPOINT_NAMES)
        if unknown:
            raise ValueError(f"remat_names {sorted(unknown)} unknown; choose from {CHECKPOINT_NAMES}")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ValueError(f"memory_budget_gib must be positive, got {self.memory_budget_gib}")
        if (self.block_q is not None and self.block_q < 1) or (self.block_kv is not None and self.block_kv < 1):
            raise ValueError(f"block sizes must be positive, got {self.block_q}, {self.block_kv}")

    def decode_step_tokens(self, quantized: bool) -> int:
        """The decode kernel's tokens per grid step for an int8 (`quantized`) or a
        bf16/float32 cache."""
        return self.decode_int8_tokens_per_step if quantized else self.decode_tokens_per_step

    def checkpoint_policy(self):
        """The `jax.checkpoint` policy for one scanned layer (`None`: recompute all)."""
        if self.remat == "auto":
            raise ValueError(
                'remat="auto" is a choice to make before compiling: resolve it with eqx_tx.train.remat_auto '
                "(train_step does)"
            )
        if self.remat == "offload":
            return jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.remat_names), names_which_can_be_offloaded=[LAYER_INPUT],
                offload_src="device", offload_dst="pinned_host",
            )
        if self.remat == "dots":
            return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if self.remat == "names":
            return jax.checkpoint_policies.save_only_these_names(*self.remat_names)
        return None
