"""The pre-norm decoder block and the scan that runs a stack of them."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from ..cache.base import AbstractCache
from ..core.compute import LAYER_INPUT, ComputeConfig
from ..core.sharding import constrain
from .attention import Attention
from .inputs import LayerInputs
from .mlp import GatedMLP
from .moe import MoE, RouterStats
from .norm import RMSNorm


class BlockOutput(eqx.Module):
    """What a decoder block (or the whole stack) returns.

    - `hidden`: the hidden states after the block.
    - `cache`: the cache with this block's keys/values written (`None` without one).
    - `router_stats`: MoE router statistics (summed over the stack's layers by
      `run_stack`); `None` for dense models.
    """

    hidden: Float[Array, "batch seq embed"]
    cache: AbstractCache | None = None
    router_stats: RouterStats | None = None


class DecoderBlock(eqx.Module):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP | MoE

    def __init__(self, *, input_layernorm, self_attn, post_attention_layernorm, mlp):
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def __call__(self, x: Float[Array, "batch seq embed"], inputs: LayerInputs) -> BlockOutput:
        """**Arguments:** the hidden states and the layer's `LayerInputs`. **Returns:** a
        `BlockOutput` (with this layer's router statistics for an MoE block)."""
        with jax.named_scope("attn"):
            h, cache = self.self_attn(self.input_layernorm(x), inputs)
        x = x + checkpoint_name(h, "block_attn_out")
        with jax.named_scope("mlp"):
            if isinstance(self.mlp, MoE):
                mask, positions = inputs.mask, inputs.positions
                valid = None if mask.kv_lengths is None else positions < mask.kv_lengths[:, None]
                if mask.segment_ids is not None:
                    valid = (mask.segment_ids != 0) if valid is None else valid & (mask.segment_ids != 0)
                y, stats = self.mlp(self.post_attention_layernorm(x), valid, mesh=inputs.mesh)
                return BlockOutput(x + y, cache, stats)
            return BlockOutput(x + self.mlp(self.post_attention_layernorm(x)), cache)


def stack_length(stacked: eqx.Module) -> int:
    """Number of layers in a stacked module (the leading axis of its arrays)."""
    return jax.tree.leaves(eqx.filter(stacked, eqx.is_array))[0].shape[0]


def unstack(stacked: DecoderBlock) -> tuple[DecoderBlock, ...]:
    """The stacked blocks as one block per layer, each array sliced out of the stack
    (a copy of the layer weights: under `jit`, one buffer per layer)."""
    params, static = eqx.partition(stacked, eqx.is_array)
    return tuple(
        eqx.combine(jax.tree.map(lambda a: a[i], params), static) for i in range(stack_length(stacked))
    )


def activation_axes(compute: ComputeConfig) -> tuple[str, str, str]:
    """Logical axes of the hidden states between blocks.

    With sequence parallelism the sequence is split over `tp` as well: XLA then
    all-gathers it before the column-parallel projections and reduce-scatters the
    row-parallel outputs (Megatron-style), and the carry saved for the backward pass
    is 1/tp the size per device.
    """
    return ("batch", "seq_parallel" if compute.sequence_parallel else "seq", "act_embed")


def run_stack(
    layers: DecoderBlock | tuple[DecoderBlock, ...],
    x: Float[Array, "batch seq embed"],
    inputs: LayerInputs,
    *,
    stats: RouterStats | None = None,
) -> BlockOutput:
    """Run the stacked blocks with `lax.scan`, each step under `filter_checkpoint`.

    The scan body returns only its carry, a `BlockOutput`: the hidden states (and,
    when sampling, the cache, written in place at this layer's index; for MoE
    models, the router statistics summed over layers, starting from `stats`).
    Returning per-layer outputs or parameters would make XLA keep a second stacked
    copy.

    A tuple of per-layer blocks (`unstack`) runs unrolled, one block after another
    (decoding on CPU: see `ComputeConfig.decode_layers`). `inputs.cache` is the
    cache the first layer reads; each layer gets it with its keys/values written so
    far, and its index.
    """
    compute, cache = inputs.compute, inputs.cache
    axes = activation_axes(compute)

    def apply(carry: BlockOutput, block: DecoderBlock, index: Int[Array, ""]) -> BlockOutput:
        out = block(checkpoint_name(carry.hidden, LAYER_INPUT), inputs.at_layer(index, carry.cache))
        total = carry.router_stats
        if total is not None and out.router_stats is not None:
            total = total + out.router_stats
        return BlockOutput(constrain(out.hidden, axes), out.cache, total)

    if isinstance(layers, tuple):
        out = BlockOutput(constrain(x, axes), cache, stats)
        for index, block in enumerate(layers):
            out = apply(out, block, jnp.asarray(index, jnp.int32))
        return out
    params, static = eqx.partition(layers, eqx.is_array)

    def body(carry: BlockOutput, xs):
        layer_params, index = xs
        return apply(carry, eqx.combine(layer_params, static), index), None

    if cache is None and compute.remat != "none":
        # prevent_cse=False: the scan already stops XLA from merging the recomputation
        # with the forward pass across iterations, and the CSE barriers would only
        # block fusions inside the layer.
        body = eqx.filter_checkpoint(body, policy=compute.checkpoint_policy(), prevent_cse=False)
    out, _ = jax.lax.scan(
        body, BlockOutput(constrain(x, axes), cache, stats), (params, jnp.arange(stack_length(layers)))
    )
    return out
