"""The one place an attention path is chosen.

`select_attention` takes what the choice depends on — the query and key/value
shapes and dtype, the kind of cache being read, where the queries start, the mesh
and the `ComputeConfig` — and returns one backend with the reason for it, logged
once per distinct reason:

- `"ring"`: context parallelism (the mesh has `sp > 1`, no cache): keys/values
  travel around the `sp` ring, blockwise inside (`eqx_tx.kernels.ring`).
- `"shared_prefix"`: `n` samples reading one stored prompt plus their own
  completions, merged by log-sum-exp (`eqx_tx.kernels.shared_prefix`).
- `"decode_tpu"`: on a TPU, one query per sequence over a dense cache or page pool
  (bf16 or int8) read in place by a Pallas kernel (`eqx_tx.kernels.decode_tpu`);
  for a shared prompt's samples, each one's completion read in place and the prompt
  once per group of its samples.
- `"paged"`: the engine's page pool, walked block by block (`eqx_tx.kernels.paged`);
  another requested implementation cannot read a page pool, which is logged.
- `"cudnn"`, `"splash"`, `"blockwise"`, `"xla"`: the single-device kernels of
  `eqx_tx.kernels.sdpa`. Under `attention="auto"`: cuDNN where it can run (a GPU),
  else once the score tile reaches `AUTO_BLOCKWISE_MIN_SCORES` splash where it can
  run (a TPU) and blockwise where not, else xla.

The choice also fixes the tile sizes: `ComputeConfig.block_q/block_kv` when given,
else the platform's `DEFAULT_BLOCKS` (measured: `benchmarks/benchmark_attention.py`)
or, for splash, `SPLASH_BLOCKS` (`benchmarks/splash_tiles.py`), shrunk to divide the
sequence.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.compute import AttentionImpl, ComputeConfig
from ..core.log import log_once
from ..core.sharding import AnyMesh, current_mesh, mesh_axis_size
from .decode_tpu import DENSE_BLOCK, decode_tpu_reason, dense_block
from .quantized import Quantized
from .sdpa import attend
from .splash import LANES, head_sharding_mismatch, padded_length, splash_tile

Backend = Literal["cudnn", "splash", "decode_tpu", "blockwise", "xla", "ring", "shared_prefix", "paged"]
# What is read: no cache (a call's own keys), a dense cache (bf16/fp32 or int8), a
# shared-prompt cache (either dtype), a page pool (either dtype). Each cache kind
# names itself (`eqx_tx.cache`).
CacheKind = Literal["none", "dense", "int8", "shared_prefix", "shared_prefix_int8", "paged", "paged_int8"]
_SHARED = ("shared_prefix", "shared_prefix_int8")
# Measured on a TPU v5e (Qwen3-0.6B shape, 1k prompts x 8 samples x 8, bf16,
# `benchmarks/decode_sweep.py --n 8`): 5.54 ms a decode step on the kernel, 7.80 ms
# over the blockwise parts.
_SHARED_IN_PLACE = ("each sample's completion read in place, its prompt once per group of its samples "
                    "(1.4x the blockwise parts on a TPU v5e)")

# Under "auto", queries*keys at or above this use blockwise instead of xla.
AUTO_BLOCKWISE_MIN_SCORES = 512 * 512

# Blockwise tiles (block_q, block_kv) per platform when ComputeConfig leaves them
# unset. On XLA:CPU 256 x 256 tiles beat 512 x 512 by ~1.3x forward and backward
# (fewer masked scores in the causal diagonal, tiles that stay in cache); GPUs
# (where blockwise is the fallback of cuDNN) keep larger tiles. On a TPU v5e 512 x 512
# blockwise tiles train 1.5x faster than 1024 x 1024 (`benchmarks/results/
# accelerator_tpu_v5e.md`).
DEFAULT_BLOCKS = {"cpu": (256, 256), "gpu": (512, 512), "tpu": (512, 512)}
# Splash tiles when ComputeConfig leaves them unset (shrunk to divide the sequence):
# a Qwen3-0.6B training step on a TPU v5e, 377 ms with these against 384 ms at 512 x 512.
SPLASH_BLOCKS = (1024, 1024)


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """The backend that runs, why, and the blockwise tile sizes (used by the
    blockwise, ring and shared-prefix backends)."""

    backend: Backend
    reason: str
    block_q: int = DEFAULT_BLOCKS["gpu"][0]
    block_kv: int = DEFAULT_BLOCKS["gpu"][1]


def target_platform(mesh: AnyMesh | None) -> str:
    """The platform being compiled for: the mesh's devices, else the default backend.

    (A mesh of compile-only CUDA devices makes this "gpu" on a machine without one.)
    """
    if mesh is not None:
        abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
        device = abstract.abstract_device
        if device is not None:
            return "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform
    return jax.default_backend()


def _cudnn_reason(q_shape, k_shape, dtype, q_offset, mesh) -> str | None:
    """Why cuDNN cannot run here (`None` if it can)."""
    platform = target_platform(mesh)
    if platform != "gpu":
        return f"backend is {platform}, not gpu"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"dtype {jnp.dtype(dtype)} (cuDNN flash attention needs bf16/fp16)"
    head_dim = q_shape[-1]
    if head_dim > 256 or head_dim % 8:
        return f"head_dim {head_dim} not supported by cuDNN"
    single_query = q_shape[1] == 1
    if not single_query and not (isinstance(q_offset, int) and q_offset == 0):
        return "queries start after position 0 (cache offset); cuDNN's causal mask is top-left aligned"
    if mesh is not None:  # cuDNN's partitioner needs q, k and v laid out alike
        return head_sharding_mismatch(q_shape, k_shape, mesh)
    return None


def _splash_reason(q_shape, k_shape, cache: CacheKind, q_offset, mesh) -> str | None:
    """Why the splash kernel cannot run here (`None` if it can)."""
    platform = target_platform(mesh)
    if platform != "tpu":
        return f"backend is {platform}, not tpu"
    if cache != "none":
        return "it reads a KV cache"
    if not (isinstance(q_offset, int) and q_offset == 0):
        return "queries start after position 0"
    T, S, head_dim = q_shape[1], k_shape[1], q_shape[-1]
    if T != S:
        return f"{T} queries attend to {S} keys (splash here is self-attention)"
    if head_dim % LANES:
        return f"head_dim {head_dim} is not a multiple of {LANES}"
    if mesh is not None and mesh.size > 1:
        return head_sharding_mismatch(q_shape, k_shape, mesh)
    return None


def _decode_reason(q_shape, k_shape, dtype, cache: CacheKind, mesh, page_size: int | None, *,
                   interpreted: bool = False) -> str | None:
    """Why the decode kernel cannot run here (`None` if it can); `interpreted`: in
    Pallas's interpreter (off a TPU), which takes any shape."""
    platform = target_platform(mesh)
    if platform != "tpu" and not interpreted:
        return f"backend is {platform}, not tpu"
    if cache not in ("dense", "int8", "paged", "paged_int8", *_SHARED):
        return f"it reads a {cache} cache" if cache != "none" else "there is no KV cache"
    if q_shape[1] != 1:
        return f"{q_shape[1]} queries per sequence (the kernel decodes one)"
    if mesh is not None and mesh.size > 1:
        return f"a mesh of {mesh.size} devices"
    if interpreted:
        return None
    int8_block = None
    if cache == "int8":
        int8_block = dense_block(k_shape[1], DENSE_BLOCK)
    elif cache in ("paged_int8", "shared_prefix_int8"):
        assert page_size is not None, "a page pool's page size, or the blocks a shared prompt's parts are read in"
        int8_block = page_size
    return decode_tpu_reason(head_dim=q_shape[-1], kv_heads=k_shape[-2], heads=q_shape[2], dtype=dtype,
                             int8_block=int8_block)


def _requested_decode(q_shape, k_shape, dtype, cache: CacheKind, mesh, page_size) -> AttentionChoice:
    """`decode_tpu` as requested for a decoding call: the kernel, in Pallas's
    interpreter off a TPU; `ValueError` naming why it cannot run."""
    platform = target_platform(mesh)
    reason = _decode_reason(q_shape, k_shape, dtype, cache, mesh, page_size, interpreted=platform != "tpu")
    if reason is not None:
        raise ValueError(f"attention implementation 'decode_tpu' cannot run: {reason}")
    return AttentionChoice("decode_tpu", "requested" + ("" if platform == "tpu" else
                                                        f" (backend is {platform}: Pallas interpreter)"))


def _choose(q_shape, k_shape, dtype, cache: CacheKind, q_offset, mesh, requested: AttentionImpl,
            segmented: bool, page_size: int | None) -> AttentionChoice:
    T, S = q_shape[1], k_shape[1]
    if segmented and cache != "none":
        raise ValueError("segment ids (packed sequences) are for attention without a KV cache")
    if cache == "none" and mesh_axis_size(mesh, "sp") > 1:
        return AttentionChoice("ring", "context parallel over sp, blockwise inside")
    if requested == "decode_tpu":  # decoding on the kernel; any other call as under auto
        if T == 1 and cache != "none":
            return _requested_decode(q_shape, k_shape, dtype, cache, mesh, page_size)
        requested = "auto"
    decode_reason = _decode_reason(q_shape, k_shape, dtype, cache, mesh, page_size)
    if requested == "auto" and decode_reason is None:
        return AttentionChoice("decode_tpu", _SHARED_IN_PLACE if cache in _SHARED else
                               "one query per sequence, the stacked cache read in place")
    # A decoding call on a TPU that falls back says why the kernel did not run.
    not_decode = (f"not decode_tpu because {decode_reason}"
                  if T == 1 and decode_reason is not None and target_platform(mesh) == "tpu" else None)
    if cache in _SHARED:  # under any other implementation too
        why = f"; {not_decode}" if not_decode else ""
        return AttentionChoice("shared_prefix", f"prompt and completion parts, blockwise, merged by log-sum-exp{why}")
    if cache in ("paged", "paged_int8"):
        if requested != "auto":
            return AttentionChoice("paged", f"requested {requested}, which cannot read a page pool; the pool walked "
                                            "block by block, eqx_tx.kernels.paged")
        why = f"; {not_decode}" if not_decode else ""
        return AttentionChoice("paged", f"the page pool walked block by block, eqx_tx.kernels.paged{why}")
    if cache == "int8":
        if requested == "cudnn":
            raise ValueError("attention implementation 'cudnn' cannot read an int8 KV cache; use blockwise")
        if requested == "xla":
            return AttentionChoice("xla", "requested; the int8 cache is dequantized whole (reference)")
        why = f", {not_decode}" if not_decode else ""
        return AttentionChoice("blockwise", f"the KV cache is int8 (dequantized block by block{why})")
    if segmented and requested in ("cudnn", "auto"):
        # jax.nn.dot_product_attention's cuDNN path takes no segment ids.
        why = "segment ids (packed sequences): cuDNN path takes none"
        if requested == "cudnn" or _cudnn_reason(q_shape, k_shape, dtype, q_offset, mesh) is None:
            return AttentionChoice("blockwise", f"not cudnn because of {why}")
    if requested == "cudnn":
        reason = _cudnn_reason(q_shape, k_shape, dtype, q_offset, mesh)
        if reason is not None:
            raise ValueError(f"attention implementation 'cudnn' cannot run: {reason}")
        return AttentionChoice("cudnn", "requested")
    if requested == "splash":
        reason = _splash_reason(q_shape, k_shape, cache, q_offset, mesh)
        if reason is not None:
            raise ValueError(f"attention implementation 'splash' cannot run: {reason}")
        return AttentionChoice("splash", "requested")
    if requested != "auto":
        return AttentionChoice(requested, "requested")
    reason = _cudnn_reason(q_shape, k_shape, dtype, q_offset, mesh)
    if reason is None:
        return AttentionChoice("cudnn", f"{jnp.dtype(dtype)}, q_seq={T}, kv_seq={S}")
    if T * S >= AUTO_BLOCKWISE_MIN_SCORES:
        splash_reason = _splash_reason(q_shape, k_shape, cache, q_offset, mesh)
        if splash_reason is None:
            return AttentionChoice("splash", f"not cudnn because {reason}; seq={T}")
        return AttentionChoice("blockwise", f"not cudnn because {reason}, not splash because {splash_reason} "
                                            f"(q_seq={T}, kv_seq={S})")
    if cache == "dense" and not_decode:
        reason = f"{reason}, {not_decode}"
    return AttentionChoice("xla", f"not cudnn because {reason}; scores {T}x{S} are small")


def select_attention(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    dtype,
    *,
    cache: CacheKind,
    q_offset: int | Int[Array, " batch"],
    mesh: AnyMesh | None,
    compute: ComputeConfig,
    segmented: bool = False,
    page_size: int | None = None,
) -> AttentionChoice:
    """Choose the attention backend (logged once per distinct choice and reason).

    **Arguments:**

    - `q_shape`, `k_shape`: `[batch, q_seq, heads, head_dim]` and the keys read
      (`[batch, kv_seq, kv_heads, head_dim]`; a cache's whole length).
    - `dtype`: the queries' dtype.
    - `cache`: `"none"` (training, full forward), `"dense"` or `"int8"` (a KV cache),
      `"shared_prefix"` (`_int8`) or `"paged"` (`_int8`).
    - `q_offset`: where the queries start; the Python int `0` lets cuDNN's causal
      mask run.
    - `mesh`: the mesh being compiled for (`None`: one device).
    - `compute`: the requested implementation (`compute.attention`) and tile sizes.
    - `segmented`: the queries carry segment ids (packed documents); cuDNN then
      falls back to blockwise, logged.
    - `page_size`: a page pool's tokens per page (an int8 pool's scales are read a
      page at a time); for a shared prompt, the blocks its parts are read in.

    **Returns:** an `AttentionChoice` with its tile sizes; a request that cannot run
    raises `ValueError`.
    """
    choice = _choose(tuple(q_shape), tuple(k_shape), dtype, cache, q_offset, mesh, compute.attention, segmented,
                     page_size)
    if choice.backend == "splash":
        default_q, default_kv = SPLASH_BLOCKS
    else:
        default_q, default_kv = DEFAULT_BLOCKS.get(target_platform(mesh), DEFAULT_BLOCKS["gpu"])
    bq = default_q if compute.block_q is None else compute.block_q
    bkv = default_kv if compute.block_kv is None else compute.block_kv
    if choice.backend == "splash":  # tiles of 128-multiples that divide the (padded) sequence
        seq = padded_length(q_shape[1])
        bq, bkv = splash_tile(seq, bq), splash_tile(seq, bkv)
        if bq is None or bkv is None:
            raise ValueError(f"splash tiles must be multiples of {LANES}; got block_q={compute.block_q}, "
                             f"block_kv={compute.block_kv}")
    choice = dataclasses.replace(choice, block_q=bq, block_kv=bkv)
    tiles = f", tiles {bq}x{bkv}" if choice.backend in ("splash", "blockwise", "ring", "shared_prefix") else ""
    log_once(f"attention: {choice.backend} ({choice.reason}{tiles})")
    return choice


def dot_product_attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized,
    v: Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized,
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    q_offset: int | Int[Array, " batch"] = 0,
    causal: bool = True,
    implementation: AttentionImpl = "auto",
    block_q: int | None = None,
    block_kv: int | None = None,
    scale: float | None = None,
) -> Float[Array, "batch q_seq heads head_dim"]:
    """Attention on one device (or under the context mesh), the backend chosen by
    `select_attention`: a standalone entry point for benchmarks and tests.

    **Arguments:** as `eqx_tx.kernels.sdpa.attend`, with `implementation` in place of
    the backend. **Returns:** the attention output, dtype of `q`.
    """
    compute = ComputeConfig(attention=implementation, block_q=block_q, block_kv=block_kv)
    kind: CacheKind = "int8" if isinstance(k, Quantized) else "dense"
    choice = select_attention(q.shape, k.shape, q.dtype, cache=kind, q_offset=q_offset, mesh=current_mesh(),
                              compute=compute)
    assert choice.backend in ("cudnn", "splash", "blockwise", "xla")  # ring, shared prefix, paged need their own inputs
    return attend(choice.backend, q, k, v, kv_lengths=kv_lengths, q_offset=q_offset, causal=causal,
                  block_q=choice.block_q, block_kv=choice.block_kv, scale=scale, mesh=current_mesh())
