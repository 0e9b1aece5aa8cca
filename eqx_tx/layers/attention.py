"""Multi-head attention with grouped K/V heads, optional q/k RMSNorm and biases."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from ..cache.base import AbstractCache
from ..core.sharding import constrain
from ..kernels.dispatch import select_attention
from ..kernels.ring import ring_attention
from ..kernels.sdpa import attend
from .inputs import LayerInputs
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope


class Attention(eqx.Module):
    """Self-attention: projections, q/k norm, RoPE, attention kernel, output projection."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        qkv_bias: bool = False,
        o_bias: bool = False,
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        lin = dict(dtype=dtype)
        self.q_proj = Linear(hidden_size, (num_heads, head_dim), axes=("heads", "head_dim", "embed"), use_bias=qkv_bias, key=kq, **lin)
        self.k_proj = Linear(hidden_size, (num_kv_heads, head_dim), axes=("kv_heads", "head_dim", "embed"), use_bias=qkv_bias, key=kk, **lin)
        self.v_proj = Linear(hidden_size, (num_kv_heads, head_dim), axes=("kv_heads", "head_dim", "embed"), use_bias=qkv_bias, key=kv, **lin)
        self.o_proj = Linear((num_heads, head_dim), hidden_size, axes=("embed", "heads", "head_dim"), use_bias=o_bias, key=ko, **lin)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype) if qk_norm else None

    def __call__(
        self, x: Float[Array, "batch seq embed"], inputs: LayerInputs
    ) -> tuple[Float[Array, "batch seq embed"], AbstractCache | None]:
        """Project, rotate, attend.

        **Arguments:**

        - `x`: the normalised hidden states.
        - `inputs`: positions, rotary angles, mask, compute settings, mesh, and the
          cache with this layer's index. With a cache, this layer's new keys/values are
          written at `inputs.positions` and the cache's kernel attends
          (`AbstractCache.attend`); without, attention runs over the call's own tokens.

        **Returns:** the attention output (before the residual add) and the cache.
        """
        with jax.named_scope("qkv"):
            q_bthk = self.q_proj(x)
            k_bthk = self.k_proj(x)
            v_bthk = self.v_proj(x)
            if self.q_norm is not None and self.k_norm is not None:
                q_bthk = self.q_norm(q_bthk)
                k_bthk = self.k_norm(k_bthk)
        with jax.named_scope("rope"):
            q_bthk = apply_rope(q_bthk, inputs.cos, inputs.sin)
            k_bthk = apply_rope(k_bthk, inputs.cos, inputs.sin)
        q_bthk = checkpoint_name(constrain(q_bthk, ("batch", "seq", "act_heads", None)), "q")
        k_bthk = checkpoint_name(constrain(k_bthk, ("batch", "seq", "act_kv_heads", None)), "k")
        v_bthk = checkpoint_name(constrain(v_bthk, ("batch", "seq", "act_kv_heads", None)), "v")
        cache = inputs.cache
        with jax.named_scope("attention"):
            if cache is None:
                o_bthk = self_attention(q_bthk, k_bthk, v_bthk, inputs)
            else:
                assert inputs.layer is not None
                o_bthk, cache = cache.attend(q_bthk, k_bthk, v_bthk, layer=inputs.layer, positions=inputs.positions,
                                             mask=inputs.mask, compute=inputs.compute, mesh=inputs.mesh)
            o_bthk = checkpoint_name(constrain(o_bthk, ("batch", "seq", "act_heads", None)), "attention")
        with jax.named_scope("o_proj"):
            return self.o_proj(o_bthk), cache


def self_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    inputs: LayerInputs,
) -> Float[Array, "batch seq heads head_dim"]:
    """Attention of a call's queries over its own keys (training, a full forward): a
    ring over `sp` under context parallelism, else the kernel `select_attention` picks."""
    mask, mesh = inputs.mask, inputs.mesh
    choice = select_attention(q.shape, k.shape, q.dtype, cache="none", q_offset=mask.q_offset, mesh=mesh,
                              compute=inputs.compute, segmented=mask.segment_ids is not None)
    if choice.backend == "ring":
        # The sequence is split over `sp`: keys/values travel around the ring.
        assert mesh is not None
        B = q.shape[0]
        lengths = mask.kv_lengths if mask.kv_lengths is not None else jnp.full((B,), jnp.iinfo(jnp.int32).max - 1)
        return ring_attention(q, k, v, positions=inputs.positions, kv_lengths=lengths, mesh=mesh,
                              segment_ids=mask.segment_ids, block_q=choice.block_q, block_kv=choice.block_kv)
    assert choice.backend in ("cudnn", "splash", "blockwise", "xla")
    return attend(choice.backend, q, k, v, kv_lengths=mask.kv_lengths, q_offset=mask.q_offset,
                  segment_ids=mask.segment_ids, causal=True, block_q=choice.block_q, block_kv=choice.block_kv,
                  mesh=mesh)
