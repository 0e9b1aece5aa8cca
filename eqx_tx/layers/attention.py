"""Multi-head attention with grouped K/V heads, optional q/k RMSNorm and biases."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..core.log import log_once
from ..core.compute import ComputeConfig
from ..kernels.dispatch import CacheKind, select_attention
from ..kernels.paged import paged_attention
from ..kernels.ring import ring_attention
from ..kernels.sdpa import attend
from ..kernels.shared_prefix import shared_prefix_attention
from ..core.sharding import AnyMesh, constrain, mesh_axis_size
from ..cache.dense import Cache, KVCache, PagedKVCache, SharedPrefixCache
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope


class AttentionMask(eqx.Module):
    """Which keys each query sees.

    Key `j` of sequence `b` is visible to query `i` iff `j < kv_lengths[b]` and
    `j <= q_offset[b] + i` (causal). `q_offset` is the Python int `0` when queries
    start at position 0 (training, the first prefill chunk), which lets cuDNN run.
    With `segment_ids` (packed documents, without a cache: `0` padding, `1..k`
    documents in order along the row), a key is also visible only to queries of
    its own document.
    """

    kv_lengths: Int[Array, " batch"] | None
    q_offset: int | Int[Array, " batch"] = eqx.field(default=0)
    segment_ids: Int[Array, "batch seq"] | None = None

    @classmethod
    def decode(cls, positions: Int[Array, " batch"]) -> "AttentionMask":
        """One new token per sequence at `positions`: it sees keys `[0, positions]`."""
        return cls(kv_lengths=positions + 1, q_offset=positions)


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
        mesh: AnyMesh | None = None,
        cache: Cache | None = None,
        layer: Int[Array, ""] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Cache | None]:
        """**Arguments:**

        - `x`: the normalised hidden states.
        - `cos`, `sin`: rotary angles of each position (`eqx_tx.layers.rope`).
        - `mask`: which keys each query sees.
        - `compute`: attention implementation and tile sizes.
        - `mesh`: the mesh being run on (`None`: one device); with `sp > 1` and no
          cache, attention runs as a ring over `sp`.
        - `cache`, `layer`, `positions`: with a cache, this layer's new keys/values
          are written at slots `positions` and attention reads the whole cache. With
          a `SharedPrefixCache`, `mask` describes each sample's own completion slots.

        **Returns:** the attention output (before the residual add) and the cache.
        """
        q_bthk = self.q_proj(x)
        k_bthk = self.k_proj(x)
        v_bthk = self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q_bthk = self.q_norm(q_bthk)
            k_bthk = self.k_norm(k_bthk)
        q_bthk = apply_rope(q_bthk, cos, sin)
        k_bthk = apply_rope(k_bthk, cos, sin)
        q_bthk = checkpoint_name(constrain(q_bthk, ("batch", "seq", "act_heads", None)), "q")
        k_bthk = checkpoint_name(constrain(k_bthk, ("batch", "seq", "act_kv_heads", None)), "k")
        v_bthk = checkpoint_name(constrain(v_bthk, ("batch", "seq", "act_kv_heads", None)), "v")
        if isinstance(cache, PagedKVCache):  # the engine's page pool
            assert layer is not None and positions is not None and mask.kv_lengths is not None
            cache = cache.write(layer, k_bthk, v_bthk, positions)
            log_once("attention: paged (the page pool walked block by block, eqx_tx.kernels.paged)")
            o_bthk = paged_attention(q_bthk, *cache.pools(), layer, cache.page_table, mask.kv_lengths, positions)
            o_bthk = constrain(o_bthk, ("batch", "seq", "act_heads", None))
            return self.o_proj(o_bthk), cache
        # Queries from position 0 (a prefill's first chunk) see only this chunk's keys:
        # causality hides every later slot of the cache. Attending over the chunk's own
        # keys, as the cache stores them, is exact, reads `seq` keys instead of the
        # cache's `max_len`, and is self-attention (which splash runs). Not for int8
        # caches, whose stored keys are the rounded ones.
        own_keys = (isinstance(cache, KVCache) and not cache.quantized and mask.segment_ids is None
                    and isinstance(mask.q_offset, int) and mask.q_offset == 0 and mesh_axis_size(mesh, "sp") == 1)
        keys_shape = cache.k.shape[1:] if isinstance(cache, KVCache) and not own_keys else k_bthk.shape
        kind = "none" if own_keys else _cache_kind(cache)
        choice = select_attention(q_bthk.shape, keys_shape, q_bthk.dtype, cache=kind,
                                  q_offset=mask.q_offset, mesh=mesh, compute=compute,
                                  segmented=mask.segment_ids is not None)
        bq, bkv = choice.block_q, choice.block_kv
        if choice.backend == "shared_prefix":
            assert isinstance(cache, SharedPrefixCache) and layer is not None and positions is not None
            # Completion slot t holds position prompt_length + t.
            slots = positions - jnp.repeat(cache.prompt_lengths, cache.n)[:, None]
            completion = cache.completion.write(layer, k_bthk, v_bthk, slots)
            k_own, v_own = completion.layer(layer)
            k_prompt, v_prompt = cache.prompt.layer(layer)
            assert mask.kv_lengths is not None
            o_bthk = shared_prefix_attention(
                q_bthk, k_own, v_own, k_prompt, v_prompt, own_lengths=mask.kv_lengths, own_offset=mask.q_offset,
                prompt_lengths=cache.prompt_lengths, block_q=bq, block_kv=bkv,
            )
            return self.o_proj(o_bthk), eqx.tree_at(lambda c: c.completion, cache, completion)
        if choice.backend == "ring":
            # The sequence is split over `sp`: keys/values travel around the ring.
            assert mesh is not None and positions is not None
            B = x.shape[0]
            lengths = mask.kv_lengths if mask.kv_lengths is not None else jnp.full((B,), jnp.iinfo(jnp.int32).max - 1)
            o_bthk = ring_attention(q_bthk, k_bthk, v_bthk, positions=positions, kv_lengths=lengths, mesh=mesh,
                                    segment_ids=mask.segment_ids, block_q=bq, block_kv=bkv)
        else:
            if isinstance(cache, KVCache):
                assert layer is not None and positions is not None
                cache = cache.write(layer, k_bthk, v_bthk, positions)
                if own_keys:
                    keys, values = k_bthk.astype(cache.k.dtype), v_bthk.astype(cache.v.dtype)
                else:
                    keys, values = cache.layer(layer)
            else:
                keys, values = k_bthk, v_bthk
            kv_lengths = mask.kv_lengths
            if own_keys and kv_lengths is not None:  # a prompt longer than this chunk: its keys end here
                kv_lengths = jnp.minimum(kv_lengths, k_bthk.shape[1])
            o_bthk = attend(choice.backend, q_bthk, keys, values, kv_lengths=kv_lengths, q_offset=mask.q_offset,
                            segment_ids=mask.segment_ids, causal=True, block_q=bq, block_kv=bkv, mesh=mesh)
        o_bthk = checkpoint_name(constrain(o_bthk, ("batch", "seq", "act_heads", None)), "attention")
        return self.o_proj(o_bthk), cache


def _cache_kind(cache: Cache | None) -> CacheKind:
    if cache is None:
        return "none"
    if isinstance(cache, SharedPrefixCache):
        return "shared_prefix"
    return "int8" if cache.quantized else "dense"
