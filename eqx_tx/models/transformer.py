"""The generic decoder-only causal LM that every family instantiates.

The pytree mirrors Hugging Face's module tree (`model.embed_tokens`,
`model.layers`, `model.norm`, `lm_head`), so a parameter's path is its HF key, with
the layer index inserted for the stacked `model.layers` (`eqx_tx.core.tree.stacked`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..cache.base import AbstractCache
from ..core.compute import ComputeConfig
from ..core.sharding import constrain, current_mesh
from ..core.tree import stacked
from ..kernels.mask import AttentionMask
from ..layers.attention import Attention
from ..layers.block import DecoderBlock, run_stack
from ..layers.inputs import LayerInputs
from ..layers.linear import Embedding, Linear
from ..layers.mlp import GatedMLP
from ..layers.moe import MoE, RouterStats
from ..layers.norm import RMSNorm
from ..layers.rope import rope_cos_sin
from .config import TransformerConfig


class ModelOutput(eqx.Module):
    """What `CausalLM.hidden_states` returns.

    - `hidden`: final-norm hidden states of every position (no LM head).
    - `cache`: the cache with every layer's new keys/values (`None` without one).
    - `router_stats`: MoE models: router statistics summed over layers and the tokens
      before each sequence's length (for the load-balancing loss); `None` otherwise.
    """

    hidden: Float[Array, "batch seq embed"]
    cache: AbstractCache | None = None
    router_stats: RouterStats | None = None


def make_block(config: TransformerConfig, *, dtype, key: PRNGKeyArray) -> DecoderBlock:
    """One decoder block of `config`'s architecture."""
    k_attn, k_mlp = jax.random.split(key)
    c = config
    return DecoderBlock(
        input_layernorm=RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype),
        self_attn=Attention(
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            qk_norm=c.qk_norm,
            qkv_bias=c.qkv_bias,
            o_bias=c.o_bias,
            norm_eps=c.rms_norm_eps,
            dtype=dtype,
            key=k_attn,
        ),
        post_attention_layernorm=RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype),
        mlp=(
            MoE(c.hidden_size, c.moe_intermediate_size, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                norm_topk_prob=c.norm_topk_prob, dtype=dtype, key=k_mlp)
            if c.num_experts
            else GatedMLP(c.hidden_size, c.intermediate_size, use_bias=c.mlp_bias, dtype=dtype, key=k_mlp)
        ),
    )


class Decoder(eqx.Module):
    """Embedding, the stacked blocks (every array has a leading layer axis), final norm."""

    embed_tokens: Embedding
    layers: DecoderBlock = eqx.field(metadata=stacked("layers"))
    norm: RMSNorm

    def __init__(self, config: TransformerConfig, *, dtype, key: PRNGKeyArray):
        k_embed, k_layers = jax.random.split(key)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, key=k_embed)
        keys = jax.random.split(k_layers, config.num_hidden_layers)
        self.layers = eqx.filter_vmap(lambda k: make_block(config, dtype=dtype, key=k))(keys)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class CausalLM(eqx.Module):
    """A decoder-only language model: `model` (the `Decoder`) and an optional `lm_head`."""

    model: Decoder
    lm_head: Linear | None
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """Random initialisation (normal, std 0.02; norms at 1).

        For large configs build the structure with `eqx.filter_eval_shape` (as the
        loader does) or under `jax.jit` with output shardings (`eqx_tx.init_model`),
        never eagerly.
        """
        k_model, k_head = jax.random.split(key)
        self.config = config
        self.model = Decoder(config, dtype=dtype, key=k_model)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, axes=("vocab", "embed"), dtype=dtype, key=k_head)
        )

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def head_weight(self) -> Float[Array, "vocab embed"]:
        """The LM head matrix (the embedding table when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head_logits(self, hidden: Float[Array, "*rows embed"]) -> Float[Array, "*rows vocab"]:
        """The LM head applied to every row of `hidden`, in float32. Materialises the
        full logits: training and sampling use the chunked / last-token paths."""
        return jnp.einsum("...d,vd->...v", hidden, self.head_weight(), preferred_element_type=jnp.float32)

    def hidden_states(
        self,
        input_ids: Int[Array, "batch seq"],
        *,
        positions: Int[Array, "batch seq"],
        mask: AttentionMask,
        compute: ComputeConfig,
        cache: AbstractCache | None = None,
        rope_positions: Int[Array, "batch seq"] | None = None,
    ) -> ModelOutput:
        """Final-norm hidden states of every position (no LM head).

        **Arguments:**

        - `input_ids`: token ids.
        - `positions`: each token's slot in its row (the causal order, the cache
          slot) and, unless `rope_positions` is given, its RoPE angle.
        - `mask`: which keys each query sees (with `segment_ids`: packed documents).
        - `compute`: how to run (attention kernel, remat policy).
        - `cache`: when given, keys/values are written at `positions` and attention
          reads the whole cache.
        - `rope_positions`: RoPE positions where they differ from the slots (packed
          documents: restarting at 0 in each).

        The mesh set with `jax.set_mesh` (if any) is read here, once, and passed down
        to the layers that choose a parallel path by it (ring attention over `sp`,
        experts over `ep`).

        **Returns:** a `ModelOutput`.
        """
        c = self.config
        mesh = current_mesh()
        x = self.model.embed_tokens(input_ids)
        rope_positions = positions if rope_positions is None else rope_positions
        seq_len = _longest_sequence(positions, rope_positions, mask, cache) if c.rope.depends_on_length else None
        cos, sin = rope_cos_sin(rope_positions, c.head_dim, c.rope, seq_len)
        stats = RouterStats.zeros(c.num_experts_per_tok, c.num_experts) if c.num_experts else None
        inputs = LayerInputs(positions, cos, sin, mask, compute, mesh, cache)
        out = run_stack(self.model.layers, x, inputs, stats=stats)
        # The LM head reads whole sequences (gathered again under sequence parallelism).
        hidden = constrain(self.model.norm(out.hidden), ("batch", "seq", "act_embed"))
        return ModelOutput(hidden, out.cache, out.router_stats)


def _longest_sequence(positions, rope_positions, mask: AttentionMask, cache: AbstractCache | None) -> Int[Array, ""]:
    """`max(position) + 1` over this call's real tokens (not padding): the sequence
    length that length-dependent RoPE scaling (dynamic, longrope) uses, as HF does."""
    real = jnp.ones(positions.shape, bool)
    if mask.kv_lengths is not None and not (cache is not None and cache.masks_completion_only):
        real = positions < mask.kv_lengths[:, None]  # (a shared-prefix mask covers the completion only)
    if mask.segment_ids is not None:
        real = real & (mask.segment_ids != 0)
    return jnp.max(jnp.where(real, rope_positions, 0)) + 1
