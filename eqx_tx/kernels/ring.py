"""Context parallelism: ring attention over the `sp` mesh axis, load-balanced for causal masks.

The sequence is cut into `2 * sp` chunks and device `i` holds chunks `i` and
`2 * sp - 1 - i` (`load_balanced_order`), so every device has the same amount of
unmasked causal work. Inside `shard_map`, each device keeps its queries and passes
its keys/values around the ring with `ppermute`; each visit runs the blockwise
kernel (`eqx_tx.kernels.flash`) on real positions and the partial results are merged
by their log-sum-exp. The backward pass is a second ring: queries, outputs and the
final log-sum-exp stay put, while each key/value block travels with its `dk, dv`
accumulators and arrives home after `sp` hops.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..core.log import log_once
from ..core.sharding import logical_to_spec
from ..core.util import round_up
from .flash import flash_backward, flash_forward, merge_partials, prepare_blocks

AXIS = "sp"


def load_balanced_order(seq_len: int, sp: int) -> np.ndarray:
    """Token order (original positions) placing chunks `i` and `2sp-1-i` on device `i`.

    `seq_len` must be a multiple of `2 * sp` (pad first, see `padded_length`).
    """
    if seq_len % (2 * sp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * sp = {2 * sp}")
    c = seq_len // (2 * sp)
    chunks = [ch for i in range(sp) for ch in (i, 2 * sp - 1 - i)]
    return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks]).astype(np.int32)


def padded_length(seq_len: int, sp: int) -> int:
    """The sequence length rounded up to a multiple of `2 * sp` (the padding is masked)."""
    return round_up(seq_len, 2 * sp)


def to_context_layout(arrays, sp: int):
    """Pad `[batch, seq]` arrays to `padded_length` and reorder them load-balanced.

    **Returns:** the reordered arrays, the `[batch, padded]` positions of their
    tokens, and the order (to undo: `out[:, order] = x`). Padding tokens sit at
    positions `>= seq`, beyond every sequence's length, so no real token sees them;
    give them zero loss weight.
    """
    B, T = arrays[0].shape[:2]
    order = load_balanced_order(padded_length(T, sp), sp)
    pad = len(order) - T
    out = [jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))[:, order] for x in arrays]
    positions = jnp.broadcast_to(jnp.asarray(order), (B, len(order)))
    return out, positions, order


@dataclasses.dataclass(frozen=True)
class _Ring:
    size: int


def _shift(tree, size):
    return jax.lax.ppermute(tree, AXIS, [(i, (i + 1) % size) for i in range(size)])


def _ring_forward(q, k, v, kv_lengths, q_pos, k_pos, segments, static, ring: _Ring):
    q_seg, k_seg = segments

    def step(_, carry):
        o_acc, lse_acc, k, v, k_pos, k_seg = carry
        o, lse = flash_forward(q, k, v, kv_lengths, q_pos, k_pos, static, q_seg, k_seg)
        o_acc, lse_acc = merge_partials(o_acc, lse_acc, o, lse)
        k, v, k_pos, k_seg = _shift((k, v, k_pos, k_seg), ring.size)
        return o_acc, lse_acc, k, v, k_pos, k_seg

    o0 = jnp.zeros(q.shape, jnp.float32)
    lse0 = jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
    o, lse, *_ = jax.lax.fori_loop(0, ring.size, step, (o0, lse0, k, v, k_pos, k_seg))
    return o.astype(q.dtype), lse


@eqx.filter_custom_vjp
def _ring(qkv, kv_lengths, q_pos, k_pos, segments, static, ring):
    q, k, v = qkv
    return _ring_forward(q, k, v, kv_lengths, q_pos, k_pos, segments, static, ring)


@_ring.def_fwd
def _ring_fwd(perturbed, qkv, kv_lengths, q_pos, k_pos, segments, static, ring):
    q, k, v = qkv
    out = _ring_forward(q, k, v, kv_lengths, q_pos, k_pos, segments, static, ring)
    return out, out


@_ring.def_bwd
def _ring_bwd(residuals, grads, perturbed, qkv, kv_lengths, q_pos, k_pos, segments, static, ring):
    q, k, v = qkv
    q_seg, k_seg = segments
    o, lse = residuals
    do, dlse = grads
    do = jnp.zeros_like(o) if do is None else do
    dlse = jnp.zeros_like(lse) if dlse is None else dlse

    def step(_, carry):
        dq, k, v, k_pos, k_seg, dk, dv = carry
        dq_s, dk_s, dv_s = flash_backward(q, k, v, o, lse, do, dlse, kv_lengths, q_pos, k_pos, static, q_seg, k_seg)
        k, v, k_pos, k_seg, dk, dv = _shift((k, v, k_pos, k_seg, dk + dk_s, dv + dv_s), ring.size)
        return dq + dq_s, k, v, k_pos, k_seg, dk, dv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    init = (zeros(q), k, v, k_pos, k_seg, zeros(k), zeros(v))
    dq, _, _, _, _, dk, dv = jax.lax.fori_loop(0, ring.size, step, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention(q, k, v, *, positions, kv_lengths, mesh, segment_ids=None, causal=True, block_q=512, block_kv=512,
                   scale=None):
    """Causal self-attention with the sequence sharded over the mesh's `sp` axis.

    **Arguments:**

    - `q [batch, seq, heads, head_dim]`, `k, v [batch, seq, kv_heads, head_dim]`:
      in the load-balanced token order, sequence sharded over `sp`.
    - `positions [batch, seq]`: each token's real position (the same layout).
    - `kv_lengths [batch]`: tokens at positions `>= kv_lengths` are padding.
    - `segment_ids [batch, seq]`: packed documents (the same layout; see
      `eqx_tx.kernels.flash.flash_attention`); they travel with the keys.
    - `mesh`: the (abstract) mesh with an `sp` axis; batch and heads keep their
      `dp` / `tp` sharding inside.

    **Returns:** the attention output, same layout as `q`.
    """
    size = mesh.shape[AXIS]
    q_spec = logical_to_spec(("batch", "seq", "act_heads", None), q.shape, mesh)
    k_spec = logical_to_spec(("batch", "seq", "act_kv_heads", None), k.shape, mesh)
    if q_spec[2] != k_spec[2]:
        log_once("ring attention: key/value heads do not divide over tp; heads are replicated inside the ring")
        q_spec = P(q_spec[0], q_spec[1], None, None)
        k_spec = P(k_spec[0], k_spec[1], None, None)
    pos_spec = P(q_spec[0], q_spec[1])
    len_spec = P(q_spec[0])

    def local(q, k, v, positions, kv_lengths, segment_ids=None):
        B, T, H, K = q.shape
        qkv, kvl, q_pos, k_pos, segments, static = prepare_blocks(
            q, k, v, kv_lengths=kv_lengths, q_positions=positions, k_positions=positions, q_offset=0,
            causal=causal, block_q=block_q, block_kv=block_kv, scale=scale, q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
        )
        o, _ = _ring(qkv, kvl, q_pos, k_pos, segments, static, _Ring(size))
        return o.reshape(B, -1, H, K)[:, :T]

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, k_spec, k_spec, pos_spec, len_spec) + (() if segment_ids is None else (pos_spec,)),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, positions, kv_lengths, *(() if segment_ids is None else (segment_ids,)))
