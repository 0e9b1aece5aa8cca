"""Causal self-attention on a TPU through JAX's Pallas splash-attention kernel.

`jax.experimental.pallas.ops.tpu.splash_attention` is a Mosaic (Pallas TPU) flash
kernel, forward and backward, that skips the tiles its static mask rules out. It
runs one sequence at a time with heads leading (`[heads, seq, head_dim]`, keys and
values with fewer heads for GQA), applies no score scale, and takes per-token
segment ids for anything beyond its static causal mask.

`splash_attention` maps the masking rule (`eqx_tx.kernels.mask`) onto that:

- the scale multiplies the queries;
- a causal mask over `[seq, seq]` (queries and keys are the same tokens);
- right padding (positions at or past `kv_lengths`) needs no mask: under the causal
  mask a real query sees no key after itself, so none of the padding. The kernel
  then runs without segment ids, its fastest form; a padding query sees the keys
  before it where the rule gives it none, and its output is never read;
- packed rows run with segment ids: padding (segment `0`, or past `kv_lengths`)
  becomes segment `-1`, so a padding query sees the padding keys before it (itself
  at least: no row is empty and nothing is NaN) and a real query exactly the keys
  of the rule.

A sequence that is not a multiple of 128 (the TPU's lane width) is padded to one at
the end: the padded keys come after every real query, so the causal mask hides them,
and the padded queries' rows are dropped. Tiles must be multiples of 128 that divide
the padded sequence; `splash_tile` picks them. Off a TPU the kernel runs in Pallas's interpreter (slow;
for tests: `eqx_tx.kernels.dispatch` chooses splash only on a TPU).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ..core.sharding import AnyMesh, logical_to_spec
from ..core.util import round_up

LANES = 128
# Keys per inner step of a key/value tile. On a TPU v5e (B=4, T=2048, 16 query and 8
# key/value heads of 128) forward+backward took 3.94 ms with 1024 x 1024 tiles computed
# 512 keys at a time, 4.07 ms 1024 at a time, 4.26 ms with 512 x 512 tiles, against
# 6.02 ms for the pure-JAX blockwise kernel (`benchmarks/results/accelerator_tpu_v5e.md`).
KV_COMPUTE = 512


def padded_length(seq: int) -> int:
    """The sequence length the kernel runs at: `seq` rounded up to a multiple of 128."""
    return round_up(seq, LANES)


def splash_tile(seq: int, requested: int) -> int | None:
    """The largest multiple of 128 that divides `seq` and is at most `requested`
    (`None` if there is none: `seq` is not a multiple of 128)."""
    for tile in range(min(requested, seq) // LANES * LANES, 0, -LANES):
        if seq % tile == 0:
            return tile
    return None


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, seq: int, block_q: int, block_kv: int, interpret: bool):
    """The kernel for one (heads, seq, tiles): its mask is processed once, in numpy,
    into concrete arrays (not tracers of whichever trace first asked for it)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # (imported when used: ~0.1 s)

    mask = splash.MultiHeadMask([splash.CausalMask((seq, seq)) for _ in range(heads)])
    compute = min(block_kv, KV_COMPUTE)
    blocks = splash.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=compute,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=compute,
        use_fused_bwd_kernel=True,
    )
    # The kernel's residuals (its output and log-sum-exp) carry the checkpoint name of
    # the attention output, so `remat="names"` with "attention" keeps them and the
    # backward pass does not rerun the forward kernel.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=interpret,
                                                    residual_checkpoint_name="attention")


Q_AXES = ("batch", None, "act_heads", None)  # the sequence stays whole on each device
KV_AXES = ("batch", None, "act_kv_heads", None)


def head_sharding_mismatch(q_shape, k_shape, mesh) -> str | None:
    """Why `mesh` cannot run attention shard by shard (`None` if it can): each device
    must hold whole query groups with their own key/value heads, the sequence whole
    (splash's `shard_map` and cuDNN's partitioner both need this)."""
    q_spec = logical_to_spec(Q_AXES, q_shape, mesh)
    k_spec = logical_to_spec(KV_AXES, k_shape, mesh)
    if q_spec != k_spec:
        return f"query heads and key/value heads shard differently ({q_spec} vs {k_spec})"
    return None


def splash_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    kv_lengths: Int[Array, " batch"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    block_q: int = 512,
    block_kv: int = 512,
    scale: float | None = None,
    mesh: AnyMesh | None = None,
    interpret: bool | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal self-attention from position 0 with the splash kernel.

    **Arguments:**

    - `q`, `k`, `v`: queries, keys and values of the same tokens (GQA: `heads` a
      multiple of `kv_heads`).
    - `kv_lengths`: real tokens per row (the rest is padding); `None`: all.
    - `segment_ids`: packed documents (`0` padding, `1..k` documents).
    - `block_q`, `block_kv`: tile sizes, multiples of 128 that divide `seq` rounded
      up to a multiple of 128 (`padded_length`).
    - `scale`: score scale (`None`: `head_dim ** -0.5`).
    - `mesh`: with more than one device, the kernel runs in `shard_map` on each
      device's rows (`batch` axes) and heads (`tp`), the sequence whole; query and
      key/value heads must shard alike (`head_sharding_mismatch`).
    - `interpret`: run in Pallas's interpreter (any backend; slow); `None`: when the
      default backend is not a TPU.

    **Returns:** the attention output, dtype of `q`; rows of padding queries are
    unspecified (see the module docstring).
    """
    _, T, _, K = q.shape
    if k.shape[1] != T:
        raise ValueError(f"splash attention is self-attention: {T} queries but {k.shape[1]} keys")
    padded = padded_length(T)
    for name, tile in (("block_q", block_q), ("block_kv", block_kv)):
        if tile % LANES or padded % tile:
            raise ValueError(f"splash {name}={tile} must be a multiple of {LANES} dividing the sequence ({T}, "
                             f"padded to {padded})")
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    scale = K**-0.5 if scale is None else scale
    segment_bt = None
    if segment_ids is not None:  # (right padding alone is masked by causality)
        segment_bt = segment_ids.astype(jnp.int32)
        if kv_lengths is not None:
            segment_bt = jnp.where(jnp.arange(T) < kv_lengths[:, None], segment_bt, 0)
        segment_bt = jnp.where(segment_bt == 0, -1, segment_bt)
    if padded != T:  # at the end: after every real query
        q, k, v = (jnp.pad(x, ((0, 0), (0, padded - T), (0, 0), (0, 0))) for x in (q, k, v))
        if segment_bt is not None:
            segment_bt = jnp.pad(segment_bt, ((0, 0), (0, padded - T)), constant_values=-1)

    def local(q, k, v, segment_bt=None):
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        kernel = _kernel(q.shape[2], padded, block_q, block_kv, interpret)
        q_bhtk = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)
        k_bhtk, v_bhtk = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        if segment_bt is None:
            o_bhtk = jax.vmap(kernel)(q_bhtk, k_bhtk, v_bhtk)
        else:
            o_bhtk = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(s, s)))(
                q_bhtk, k_bhtk, v_bhtk, segment_bt
            )
        return jnp.swapaxes(o_bhtk, 1, 2).astype(q.dtype)  # pyright: ignore[reportArgumentType]  (no residuals asked for)

    extra = () if segment_bt is None else (segment_bt,)
    if mesh is None or mesh.size == 1:
        return local(q, k, v, *extra)[:, :T]
    reason = head_sharding_mismatch(q.shape, k.shape, mesh)
    if reason is not None:
        raise ValueError(f"splash attention on this mesh: {reason}")
    spec = logical_to_spec(Q_AXES, q.shape, mesh)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(spec, spec, spec) + ((P(spec[0], None),) if extra else ()), out_specs=spec,
        check_vma=False,
    )(q, k, v, *extra)[:, :T]
