"""The attention kernels behind one call, `attend(backend, ...)`.

- `"cudnn"`: cuDNN fused flash attention via `jax.nn.dot_product_attention` (GPU,
  bf16/fp16; padded batches through per-sequence lengths).
- `"splash"`: JAX's Pallas splash-attention kernel (TPU; causal self-attention
  from position 0, `eqx_tx.kernels.splash`).
- `"blockwise"`: the pure-JAX flash kernel of `eqx_tx.kernels.flash` (any backend,
  O(T) memory forward and backward; reads int8 keys/values block by block).
- `"xla"`: the plain reference that materialises `[heads, q, kv]` scores; for tests
  and tiny inputs.

Which one runs is decided by `eqx_tx.kernels.dispatch.select_attention`.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..core.sharding import AnyMesh
from .flash import flash_attention
from .mask import visible
from .quantized import Quantized
from .splash import splash_attention

KernelBackend = Literal["cudnn", "splash", "blockwise", "xla"]


def _visible(B: int, T: int, S: int, kv_lengths, q_offset, causal: bool, q_segments=None,
             k_segments=None) -> Bool[Array, "batch q_seq kv_seq"]:
    """`eqx_tx.kernels.mask.visible` for queries at `q_offset + i`: `[B, T, S]`."""
    kv_lengths = jnp.full((B,), S) if kv_lengths is None else kv_lengths
    q_pos = jnp.broadcast_to(jnp.asarray(q_offset), (B,))[:, None] + jnp.arange(T) if causal else None
    segments = ((q_segments[:, :, None], k_segments[:, None, :]) if q_segments is not None and k_segments is not None
                else (None, None))
    return visible(None if q_pos is None else q_pos[:, :, None], jnp.arange(S)[None, None, :],
                   kv_lengths[:, None, None], causal=causal, q_segments=segments[0], k_segments=segments[1])


def _masked_softmax(s: Float[Array, "..."], visible: Bool[Array, "..."], *, axis: int):
    """Softmax of the float32 scores `s` over `axis` among the `visible` entries, and its
    log-normaliser: zeros and `-inf` where a query sees no key."""
    s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=axis)
    p = jnp.where(visible, jnp.exp(s - jnp.expand_dims(jnp.where(jnp.isfinite(lse), lse, 0.0), axis)), 0.0)
    return p, lse


def xla_attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    q_offset: int | Int[Array, " batch"] = 0,
    q_segment_ids: Int[Array, "batch q_seq"] | None = None,
    kv_segment_ids: Int[Array, "batch kv_seq"] | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[Float[Array, "batch q_seq heads head_dim"], Float[Array, "batch q_seq heads"]]:
    """Reference attention: materialised scores, float32 softmax, GQA by grouping.

    Same arguments and masking rule as `flash_attention`; returns `(out, lse)`.
    """
    B, T, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if T == 1 and q_segment_ids is None:
        return _single_query_attention(q, k, v, kv_lengths=kv_lengths, q_offset=q_offset, causal=causal, scale=scale)
    qg = q.reshape(B, T, Hkv, H // Hkv, K)
    s = jnp.einsum("bqhgk,bshk->bhgqs", qg, k, preferred_element_type=jnp.float32)
    s = s * (K**-0.5 if scale is None else scale)
    shown = _visible(B, T, S, kv_lengths, q_offset, causal, q_segment_ids, kv_segment_ids)
    p, lse = _masked_softmax(s, shown[:, None, None], axis=-1)
    o = jnp.einsum("bhgqs,bshk->bqhgk", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, K).astype(q.dtype), jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, T, H)


def _single_query_attention(q, k, v, *, kv_lengths, q_offset, causal: bool, scale: float | None):
    """`xla_attention` for one query per sequence (decode), as two batched matmuls that
    read the cache in its stored layout.

    A row's keys, viewed as `[kv_seq, kv_heads * head_dim]`, are multiplied by a
    block-diagonal matrix that holds each query head in its key/value head's block, so
    the scores are one `[kv_seq, C] x [C, heads]` matmul per row. The probabilities
    multiply the values the same way, and each head keeps its own block of the result.
    That does `kv_heads` times the multiply-adds of the attention proper, but reads
    each layer's cache once, in place, as a matmul operand: a `dot` batched over
    `[batch, kv_heads]` makes XLA:CPU copy the cache into a dot layout on every step,
    and multiply-reduces over it run far below bandwidth (whole-model decode 1.6x
    faster than the multiply-reduce at batch 16 after a 1000-token prompt, equal after
    128 tokens; `benchmarks/results/speed_cpu.md`).
    """
    B, _, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    own_block = jnp.eye(Hkv, dtype=bool)[:, None, :, None]  # [kv head of the query, 1, kv block, 1]
    q_block_bhc = jnp.where(own_block, q.reshape(B, Hkv, G, 1, K), 0).reshape(B, H, Hkv * K)
    s_bsh = jnp.einsum("bsc,bhc->bsh", k.reshape(B, S, Hkv * K), q_block_bhc, preferred_element_type=jnp.float32)
    s_bsh = s_bsh * (K**-0.5 if scale is None else scale)
    visible_bs1 = _visible(B, 1, S, kv_lengths, q_offset, causal)[:, 0, :, None]
    p_bsh, lse_bh = _masked_softmax(s_bsh, visible_bs1, axis=1)
    o_bhc = jnp.einsum("bsh,bsc->bhc", p_bsh.astype(v.dtype), v.reshape(B, S, Hkv * K), preferred_element_type=jnp.float32)
    # Each head's own value block: the diagonal over (query's kv head, value block).
    o_bgkn = jnp.diagonal(o_bhc.reshape(B, Hkv, G, Hkv, K), axis1=1, axis2=3)  # [B, G, K, Hkv]
    o_bngk = jnp.moveaxis(o_bgkn, -1, 1)  # [B, Hkv, G, K]
    return o_bngk.reshape(B, 1, H, K).astype(q.dtype), lse_bh.reshape(B, 1, H)


def cudnn_attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    q_offset: int | Int[Array, " batch"] = 0,
    causal: bool = True,
    scale: float | None = None,
) -> Float[Array, "batch q_seq heads head_dim"]:
    """cuDNN fused attention with the masking rule of `flash_attention`.

    cuDNN's causal mask is top-left aligned, so causal queries must start at
    position 0 — except a single query per sequence at position `q_offset`, which
    sees keys `[0, q_offset]`: exactly a key-length mask, run without a causal mask.
    """
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if causal and T == 1:
        if kv_lengths is None:
            kv_lengths = jnp.broadcast_to(jnp.asarray(q_offset) + 1, (B,))
        causal = False
    kv_lengths = jnp.full((B,), S, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=causal,
        query_seq_lengths=jnp.full((B,), T, jnp.int32) if not causal else None,
        key_value_seq_lengths=kv_lengths,
        implementation="cudnn",
    )


def attend(
    backend: KernelBackend,
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized,
    v: Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized,
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    q_offset: int | Int[Array, " batch"] = 0,
    segment_ids: Int[Array, "batch seq"] | None = None,
    causal: bool = True,
    block_q: int = 512,
    block_kv: int = 512,
    scale: float | None = None,
    mesh: AnyMesh | None = None,
) -> Float[Array, "batch q_seq heads head_dim"]:
    """Attention of `q` over `k, v` on `backend`, with the masking rule of `flash_attention`.

    **Arguments:** as `eqx_tx.kernels.flash.flash_attention`; `segment_ids` are the
    packed documents of a self-attention (queries and keys are the same tokens; not
    on cuDNN). Int8 (`Quantized`) keys and values are read block by block by
    `blockwise` and dequantized whole by `xla`. `mesh`: the mesh splash runs on,
    shard by shard (XLA partitions the others).

    **Returns:** the attention output, dtype of `q`.
    """
    if backend == "blockwise":
        return flash_attention(q, k, v, kv_lengths=kv_lengths, q_offset=q_offset, q_segment_ids=segment_ids,
                               kv_segment_ids=segment_ids, causal=causal, block_q=block_q, block_kv=block_kv,
                               scale=scale)[0]
    if isinstance(k, Quantized) or isinstance(v, Quantized):
        if backend == "cudnn":
            raise ValueError("attention backend 'cudnn' cannot read an int8 KV cache")
        k = k.dequantize(q.dtype) if isinstance(k, Quantized) else k
        v = v.dequantize(q.dtype) if isinstance(v, Quantized) else v
    if backend == "splash":
        if not causal or not (isinstance(q_offset, int) and q_offset == 0):
            raise ValueError("attention backend 'splash' runs causal self-attention from position 0")
        return splash_attention(q, k, v, kv_lengths=kv_lengths, segment_ids=segment_ids, block_q=block_q,
                                block_kv=block_kv, scale=scale, mesh=mesh)
    if backend == "cudnn":
        if segment_ids is not None:
            raise ValueError("attention backend 'cudnn' does not take segment ids (packed sequences)")
        return cudnn_attention(q, k, v, kv_lengths=kv_lengths, q_offset=q_offset, causal=causal, scale=scale)
    return xla_attention(q, k, v, kv_lengths=kv_lengths, q_offset=q_offset, q_segment_ids=segment_ids,
                         kv_segment_ids=segment_ids, causal=causal, scale=scale)[0]
