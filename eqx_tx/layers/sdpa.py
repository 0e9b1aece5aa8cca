"""Scaled dot-product attention with a selectable implementation.

- `"cudnn"`: cuDNN fused flash attention via `jax.nn.dot_product_attention` (GPU,
  bf16/fp16; padded batches through per-sequence lengths).
- `"blockwise"`: the pure-JAX flash kernel of `eqx_tx.layers.flash` (any backend,
  O(T) memory forward and backward).
- `"xla"`: the plain reference that materialises `[heads, q, kv]` scores; for tests
  and tiny inputs.
- `"auto"` (the default): cudnn where it is available and applicable, otherwise
  blockwise when the score tensor would be large, otherwise xla. The path taken is
  logged once per distinct reason.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._log import log_once
from ..sharding import current_mesh, logical_to_spec
from .flash import flash_attention
from .kv_cache import Quantized

Implementation = Literal["auto", "cudnn", "blockwise", "xla"]
IMPLEMENTATIONS = ("auto", "cudnn", "blockwise", "xla")

# Under "auto", queries*keys at or above this use blockwise instead of xla.
AUTO_BLOCKWISE_MIN_SCORES = 512 * 512


def xla_attention(q, k, v, *, kv_lengths=None, q_offset=0, causal=True, scale=None):
    """Reference attention: materialised scores, float32 softmax, GQA by grouping.

    Same arguments and masking rule as `flash_attention`; returns `(out, lse)`.
    """
    B, T, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = K**-0.5 if scale is None else scale
    qg = q.reshape(B, T, Hkv, H // Hkv, K)
    s = jnp.einsum("bqhgk,bshk->bhgqs", qg, k, preferred_element_type=jnp.float32) * scale
    kv_lengths = jnp.full((B,), S) if kv_lengths is None else kv_lengths
    q_pos = jnp.broadcast_to(jnp.asarray(q_offset), (B,))[:, None] + jnp.arange(T)
    k_pos = jnp.arange(S)
    visible = k_pos[None, None, :] < kv_lengths[:, None, None]
    if causal:
        visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(visible[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bhgqs,bshk->bqhgk", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, K).astype(q.dtype), jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, T, H)


def _cudnn_attention(q, k, v, *, kv_lengths, causal, scale):
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
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


def target_platform() -> str:
    """The platform being compiled for: the context mesh's devices, else the default backend.

    (A mesh of compile-only CUDA devices makes this "gpu" on a machine without one.)
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    if device is not None:
        return "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform
    return jax.default_backend()


def _cudnn_reason(q, k, q_offset) -> str | None:
    """Why cuDNN cannot run here (`None` if it can)."""
    platform = target_platform()
    if platform != "gpu":
        return f"backend is {platform}, not gpu"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN flash attention needs bf16/fp16)"
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        return f"head_dim {q.shape[-1]} not supported by cuDNN"
    if not (isinstance(q_offset, int) and q_offset == 0):
        return "queries start after position 0 (cache offset); cuDNN's causal mask is top-left aligned"
    mesh = current_mesh()
    if mesh is not None:
        q_spec = logical_to_spec(("batch", None, "act_heads", None), q.shape, mesh)
        k_spec = logical_to_spec(("batch", None, "act_kv_heads", None), k.shape, mesh)
        if q_spec != k_spec:  # cuDNN's partitioner needs q, k and v laid out alike
            return f"query heads and key/value heads shard differently ({q_spec} vs {k_spec})"
    return None


def dot_product_attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    q_offset: int | Int[Array, " batch"] = 0,
    causal: bool = True,
    implementation: Implementation = "auto",
    block_q: int = 512,
    block_kv: int = 512,
    scale: float | None = None,
) -> Float[Array, "batch q_seq heads head_dim"]:
    """Attention of `q` over `k, v` with the masking rule of `flash_attention`.

    **Arguments:** as `eqx_tx.layers.flash.flash_attention`, plus `implementation`
    (see the module docstring). `q_offset` must be the Python int `0` for cuDNN with
    causal masking (training, first prefill chunk); a decode step with a single query
    uses cuDNN without a causal mask instead.

    **Returns:** the attention output, dtype of `q`.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
    T, S = q.shape[1], k.shape[1]
    if isinstance(k, Quantized):
        if implementation == "cudnn":
            raise ValueError("attention implementation 'cudnn' cannot read an int8 KV cache; use blockwise")
        if implementation == "xla":  # the reference: dequantizes the whole layer
            k, v = k.dequantize(q.dtype), v.dequantize(q.dtype)
        else:
            log_once("attention: blockwise, because the KV cache is int8 (dequantized block by block)")
            implementation = "blockwise"
    single_query = T == 1 and causal
    impl = implementation
    if impl == "auto":
        reason = _cudnn_reason(q, k, 0 if single_query else q_offset)
        if reason is None:
            impl = "cudnn"
            log_once(f"attention: cudnn ({q.dtype}, q_seq={T}, kv_seq={S})")
        elif T * S >= AUTO_BLOCKWISE_MIN_SCORES:
            impl = "blockwise"
            log_once(f"attention: blockwise, not cudnn because {reason} (q_seq={T}, kv_seq={S})")
        else:
            impl = "xla"
            log_once(f"attention: xla, not cudnn because {reason}; scores {T}x{S} are small")
    elif impl == "cudnn":
        reason = _cudnn_reason(q, k, 0 if single_query else q_offset)
        if reason is not None:
            raise ValueError(f"attention implementation 'cudnn' cannot run: {reason}")

    if impl == "cudnn":
        if single_query:
            # One query per sequence at position q_offset sees keys [0, q_offset]:
            # that is exactly a key-length mask, no causal mask needed.
            if kv_lengths is None:
                kv_lengths = jnp.broadcast_to(jnp.asarray(q_offset) + 1, (q.shape[0],))
            return _cudnn_attention(q, k, v, kv_lengths=kv_lengths, causal=False, scale=scale)
        return _cudnn_attention(q, k, v, kv_lengths=kv_lengths, causal=causal, scale=scale)
    kwargs = dict(kv_lengths=kv_lengths, q_offset=q_offset, causal=causal, scale=scale)
    if impl == "blockwise":
        return flash_attention(q, k, v, block_q=block_q, block_kv=block_kv, **kwargs)[0]
    return xla_attention(q, k, v, **kwargs)[0]
