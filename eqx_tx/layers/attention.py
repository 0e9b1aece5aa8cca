"""Multi-head attention with grouped K/V heads, optional q/k RMSNorm and biases."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..compute import ComputeConfig
from .._log import log_once
from ..sharding import constrain, context_parallel_size, current_mesh
from .flash import flash_attention, merge_partials
from .kv_cache import KVCache, SharedPrefixCache
from .linear import Linear
from .norm import RMSNorm
from .ring import ring_attention
from .rope import apply_rope
from .sdpa import dot_product_attention


class AttentionMask(eqx.Module):
    """Which keys each query sees.

    Key `j` of sequence `b` is visible to query `i` iff `j < kv_lengths[b]` and
    `j <= q_offset[b] + i` (causal). `q_offset` is the Python int `0` when queries
    start at position 0 (training, the first prefill chunk), which lets cuDNN run.
    """

    kv_lengths: Int[Array, " batch"] | None
    q_offset: int | Int[Array, " batch"] = eqx.field(default=0)


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
        self,
        x: Float[Array, "batch seq embed"],
        *,
        cos: Float[Array, "batch seq head_dim"],
        sin: Float[Array, "batch seq head_dim"],
        mask: AttentionMask,
        compute: ComputeConfig,
        cache: KVCache | SharedPrefixCache | None = None,
        layer: Int[Array, ""] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVCache | SharedPrefixCache | None]:
        """**Arguments:**

        - `x`: the normalised hidden states.
        - `cos`, `sin`: rotary angles of each position (`eqx_tx.layers.rope`).
        - `mask`: which keys each query sees.
        - `compute`: attention implementation and tile sizes.
        - `cache`, `layer`, `positions`: with a cache, this layer's new keys/values
          are written at slots `positions` and attention reads the whole cache. With
          a `SharedPrefixCache`, `mask` describes each sample's own completion slots.

        **Returns:** the attention output (before the residual add) and the cache.
        """
        q_bthk = self.q_proj(x)
        k_bthk = self.k_proj(x)
        v_bthk = self.v_proj(x)
        if self.q_norm is not None:
            q_bthk = self.q_norm(q_bthk)
            k_bthk = self.k_norm(k_bthk)
        q_bthk = apply_rope(q_bthk, cos, sin)
        k_bthk = apply_rope(k_bthk, cos, sin)
        q_bthk = checkpoint_name(constrain(q_bthk, ("batch", "seq", "act_heads", None)), "q")
        k_bthk = checkpoint_name(constrain(k_bthk, ("batch", "seq", "act_kv_heads", None)), "k")
        v_bthk = checkpoint_name(constrain(v_bthk, ("batch", "seq", "act_kv_heads", None)), "v")
        if cache is None and context_parallel_size() > 1:
            # The sequence is split over `sp`: keys/values travel around the ring.
            B = x.shape[0]
            lengths = mask.kv_lengths if mask.kv_lengths is not None else jnp.full((B,), jnp.iinfo(jnp.int32).max - 1)
            o_bthk = ring_attention(
                q_bthk, k_bthk, v_bthk, positions=positions, kv_lengths=lengths, mesh=current_mesh(),
                block_q=compute.block_q, block_kv=compute.block_kv,
            )
            log_once("attention: ring (context parallel over sp), blockwise inside")
            o_bthk = checkpoint_name(constrain(o_bthk, ("batch", "seq", "act_heads", None)), "attention")
            return self.o_proj(o_bthk), cache
        if isinstance(cache, SharedPrefixCache):
            o_bthk, cache = _shared_prefix_attention(q_bthk, k_bthk, v_bthk, cache, layer, positions, mask, compute)
            return self.o_proj(o_bthk), cache
        if cache is not None:
            cache = cache.write(layer, k_bthk, v_bthk, positions)
            k_bshk, v_bshk = cache.layer(layer)
        else:
            k_bshk, v_bshk = k_bthk, v_bthk
        o_bthk = dot_product_attention(
            q_bthk,
            k_bshk,
            v_bshk,
            kv_lengths=mask.kv_lengths,
            q_offset=mask.q_offset,
            causal=True,
            implementation=compute.attention,
            block_q=compute.block_q,
            block_kv=compute.block_kv,
        )
        o_bthk = checkpoint_name(constrain(o_bthk, ("batch", "seq", "act_heads", None)), "attention")
        return self.o_proj(o_bthk), cache


def _shared_prefix_attention(q, k, v, cache: SharedPrefixCache, layer, positions, mask: AttentionMask, compute):
    """Attention of `P * n` samples over their shared prompt plus their own completion.

    The two parts are computed separately (the prompt part with the `n` samples of
    a prompt as extra queries of that prompt's row, so nothing is copied) and merged
    by their log-sum-exp, which is exact.
    """
    S, T, H, K = q.shape
    P, n = cache.prompt_lengths.shape[0], cache.n
    prompt_lengths = jnp.repeat(cache.prompt_lengths, n)
    slots = positions - prompt_lengths[:, None]
    completion = cache.completion.write(layer, k, v, slots)
    k_own, v_own = completion.layer(layer)
    blocks = dict(block_q=compute.block_q, block_kv=compute.block_kv)
    o_own, lse_own = flash_attention(
        q, k_own, v_own, kv_lengths=mask.kv_lengths, q_offset=mask.q_offset, causal=True, **blocks
    )
    k_prompt, v_prompt = cache.prompt.layer(layer)
    o_pre, lse_pre = flash_attention(
        q.reshape(P, n * T, H, K), k_prompt, v_prompt, kv_lengths=cache.prompt_lengths, causal=False, **blocks
    )
    o_pre, lse_pre = o_pre.reshape(S, T, H, K), lse_pre.reshape(S, T, H)
    o, _ = merge_partials(o_own, lse_own, o_pre, lse_pre)
    log_once("attention: shared prefix (prompt and completion parts, blockwise), merged by log-sum-exp")
    return o.astype(q.dtype), eqx.tree_at(lambda c: c.completion, cache, completion)
