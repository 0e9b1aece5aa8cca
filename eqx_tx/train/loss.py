"""Token log-probabilities through a chunked LM head, never materialising full logits.

The final hidden states are split along the sequence into chunks of about
`chunk_size` tokens (`[batch, chunk_size // batch, embed]`, so the batch axis and
its data-parallel sharding are untouched). Each chunk's logits are computed, reduced
to the target log-probability and dropped. A custom VJP recomputes each chunk's
logits in the backward pass and accumulates the head-weight gradient chunk by chunk,
so neither pass holds more than one `[chunk, vocab]` float32 tile.
"""

import dataclasses
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..core.sharding import constrain, context_parallel_size
from ..core.util import ceil_div
from ..kernels.mask import AttentionMask
from ..kernels.ring import to_context_layout
from ..layers.moe import RouterStats
from ..models import CausalLM
from .forward import lengths_and_segments, positions_for, segment_positions

DEFAULT_CHUNK_SIZE = 8192


class TokenScores(NamedTuple):
    """What `sequence_logprobs` computes per token."""

    logprobs: Float[Array, "batch seq"]
    """float32 log-probability of each target."""
    entropy: Float[Array, "batch seq"] | None
    """float32 entropy of each next-token distribution (`None` unless asked for)."""
    router_stats: RouterStats | None
    """MoE models: the router statistics of all layers (else `None`)."""
    weighted_sum: Float[Array, ""] | None = None
    """`sum(token_weights * logprobs)` when `token_weights` were given (else `None`),
    differentiated without a second pass over the vocabulary (see `chunked_scores`)."""


@dataclasses.dataclass(frozen=True)
class _Chunking:
    positions: int  # sequence positions per chunk (within a sequence shard)
    num_chunks: int
    entropy: bool  # also return each token's entropy


# Hidden states are handled as [batch, shards, positions, embed]: `shards` is the
# number of context-parallel sequence shards (1 without), so each device loops over
# chunks of its own part of the sequence.


def _chunk_logits(h_bocd, weight_vd):
    logits = jnp.einsum("bocd,vd->bocv", h_bocd, weight_vd, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", None, "act_vocab"))


def _target_logit(logits_bocv, targets_boc):
    # A compare against an iota instead of a gather keeps the vocab axis sharded.
    hit = jnp.arange(logits_bocv.shape[-1]) == targets_boc[..., None]
    return jnp.sum(jnp.where(hit, logits_bocv, 0.0), axis=-1), hit


def _entropy(logits_bocv, lse_boc):
    """`-sum(p log p) = lse - sum(p * logits)` per token."""
    p = jnp.exp(logits_bocv - lse_boc[..., None])
    return lse_boc - jnp.sum(p * logits_bocv, axis=-1)


def _slice(x, i, c):
    return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=2)


def _add_head_grads(grads, h_bocd, weight_vd, d_logits_bocv, start):
    """`grads = (d_hidden, d_weight)` with one chunk's share added: its rows of the
    hidden-state gradient written at `start`, its part of the head-weight gradient
    summed (a `None` entry is not wanted and stays `None`)."""
    d_hidden, d_weight = grads
    if d_hidden is not None:
        d_h = jnp.einsum("bocv,vd->bocd", d_logits_bocv.astype(weight_vd.dtype), weight_vd,
                         preferred_element_type=jnp.float32)
        d_hidden = jax.lax.dynamic_update_slice_in_dim(d_hidden, d_h.astype(d_hidden.dtype), start, axis=2)
    if d_weight is not None:
        d_weight = d_weight + jnp.einsum("bocv,bocd->vd", d_logits_bocv.astype(h_bocd.dtype), h_bocd,
                                         preferred_element_type=jnp.float32)
    return d_hidden, d_weight


def _forward(hidden, weight, targets, token_weights, chunking: _Chunking, wanted=(False, False)):
    """Per token: target log-prob, logsumexp, and entropy (zeros unless asked for).

    With `token_weights`, also the gradients of `sum(token_weights * logp)` with
    respect to `hidden` and `weight` (each where `wanted`, else `None`), from the
    same logits: the backward pass of a loss linear in the log-probabilities then
    needs no second pass over the vocabulary."""
    c = chunking.positions
    wanted = wanted if token_weights is not None else (False, False)

    @jax.named_scope("loss_chunk")
    def chunk(i, carry):
        scores, grads = carry
        h = _slice(hidden, i, c)
        logits = _chunk_logits(h, weight)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt, hit = _target_logit(logits, _slice(targets, i, c))
        ent = _entropy(logits, lse) if chunking.entropy else jnp.zeros_like(lse)
        scores = tuple(jax.lax.dynamic_update_slice_in_dim(acc, x, i * c, axis=2)
                       for acc, x in zip(scores, (tgt - lse, lse, ent)))
        if any(wanted):
            w = _slice(token_weights, i, c)[..., None]
            d_logits = w * (hit.astype(jnp.float32) - jnp.exp(logits - lse[..., None]))
            grads = _add_head_grads(grads, h, weight, d_logits, i * c)
        return scores, grads

    scores = tuple(jnp.zeros(targets.shape, jnp.float32) for _ in range(3))
    grads = (jnp.zeros(hidden.shape, hidden.dtype) if wanted[0] else None,
             jnp.zeros(weight.shape, jnp.float32) if wanted[1] else None)
    (logp, lse, ent), (d_hidden, d_weight) = jax.lax.fori_loop(0, chunking.num_chunks, chunk, (scores, grads))
    return logp, lse, ent, (d_hidden, None if d_weight is None else d_weight.astype(weight.dtype))


def _weighted_sum(logp, token_weights):
    return jnp.zeros((), jnp.float32) if token_weights is None else jnp.sum(token_weights * logp)


@eqx.filter_custom_vjp
def _chunked_logprobs(hidden_weight, targets, token_weights, chunking):
    hidden, weight = hidden_weight
    logp, _, ent, _ = _forward(hidden, weight, targets, token_weights, chunking)
    return logp, ent, _weighted_sum(logp, token_weights)


@_chunked_logprobs.def_fwd
def _chunked_logprobs_fwd(perturbed, hidden_weight, targets, token_weights, chunking):
    hidden, weight = hidden_weight
    logp, lse, ent, grads = _forward(hidden, weight, targets, token_weights, chunking, wanted=tuple(perturbed))
    return (logp, ent, _weighted_sum(logp, token_weights)), (lse, ent, grads)


@_chunked_logprobs.def_bwd
def _chunked_logprobs_bwd(residuals, g, perturbed, hidden_weight, targets, token_weights, chunking):
    hidden, weight = hidden_weight
    lse, ent, fused = residuals
    g_logp, g_ent, g_sum = g
    d_hidden = jnp.zeros(hidden.shape, hidden.dtype)
    d_weight = jnp.zeros(weight.shape, jnp.float32)
    if g_logp is not None or g_ent is not None:  # per-token cotangents: a second pass over the vocabulary
        g_logp, g_ent = (jnp.zeros_like(lse) if x is None else x for x in (g_logp, g_ent))
        c = chunking.positions

        @jax.named_scope("loss_chunk_backward")
        def chunk(i, grads):
            h = _slice(hidden, i, c)
            g_c, lse_c = _slice(g_logp, i, c)[..., None], _slice(lse, i, c)[..., None]
            logits = _chunk_logits(h, weight)
            _, hit = _target_logit(logits, _slice(targets, i, c))
            p = jnp.exp(logits - lse_c)
            # d logp / d logits = onehot(target) - p;  d entropy / d logits = -p * (log p + entropy)
            d_logits = g_c * (hit.astype(jnp.float32) - p)
            if chunking.entropy:
                d_logits = d_logits - _slice(g_ent, i, c)[..., None] * p * (logits - lse_c + _slice(ent, i, c)[..., None])
            return _add_head_grads(grads, h, weight, d_logits, i * c)

        d_hidden, d_weight = jax.lax.fori_loop(0, chunking.num_chunks, chunk, (d_hidden, d_weight))
    if g_sum is not None:  # sum(w * logp): its gradients came with the forward pass
        if fused[0] is not None:
            d_hidden = d_hidden + g_sum.astype(hidden.dtype) * fused[0]
        if fused[1] is not None:
            d_weight = d_weight + g_sum * fused[1]
    return d_hidden, d_weight.astype(weight.dtype)


def chunked_logprobs(
    hidden: Float[Array, "batch seq embed"],
    weight: Float[Array, "vocab embed"],
    targets: Int[Array, "batch seq"],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Float[Array, "batch seq"]:
    """`log_softmax(hidden @ weight.T)[target]` per token, in chunks, with a chunked VJP.

    **Arguments:**

    - `hidden`: final (normed) hidden states.
    - `weight`: the LM head `[vocab, embed]` (may be vocab-sharded, or the tied embedding).
    - `targets`: target token ids.
    - `chunk_size`: tokens per chunk (per device under context parallelism); a chunk
      spans `max(1, chunk_size // batch)` positions of every sequence. The last chunk
      is padded when it does not divide.

    **Returns:** float32 log-probabilities `[batch, seq]`.
    """
    return chunked_scores(hidden, weight, targets, chunk_size=chunk_size)[0]


def chunked_scores(
    hidden: Float[Array, "batch seq embed"],
    weight: Float[Array, "vocab embed"],
    targets: Int[Array, "batch seq"],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy: bool = False,
    token_weights: Float[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, "batch seq"], Float[Array, "batch seq"] | None, Float[Array, ""] | None]:
    """`chunked_logprobs`, and:

    - with `entropy=True`, each token's entropy `-sum(p log p)` of its next-token
      distribution, computed in the same chunks and differentiable (else `None`);
    - with `token_weights`, `sum(token_weights * logprobs)` (else `None`), whose
      gradients are computed in the forward pass from the same logits, so that a loss
      linear in the log-probabilities (cross entropy) is differentiated without a
      second pass over the vocabulary. The weights are constants (not differentiated).
      Differentiating the per-token outputs as well still works, through that second
      pass.

    **Returns:** `(logprobs, entropy, weighted_sum)`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, D = hidden.shape
    shards = context_parallel_size()
    shards = shards if T % shards == 0 else 1
    L = T // shards
    positions = min(L, max(1, chunk_size // B))
    n = ceil_div(L, positions)
    pad = n * positions - L

    def layout(x, value=0):  # [B, T, ...] -> [B, shards, n * positions, ...], padded
        x = x.reshape(B, shards, L, *x.shape[2:])
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3), constant_values=value) if pad else x

    hidden = constrain(layout(hidden), ("batch", "seq", None, "act_embed"))
    targets = layout(targets.astype(jnp.int32))
    if token_weights is not None:
        token_weights = layout(jax.lax.stop_gradient(token_weights).astype(jnp.float32))
    logp, ent, weighted = _chunked_logprobs((hidden, weight), targets, token_weights, _Chunking(positions, n, entropy))
    logp, ent = (x[:, :, :L].reshape(B, T) for x in (logp, ent))
    return logp, ent if entropy else None, None if token_weights is None else weighted


def sequence_logprobs(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    target_ids: Int[Array, "batch seq"],
    lengths: Int[Array, " batch"],
    *,
    compute: ComputeConfig,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    segment_ids: Int[Array, "batch seq"] | None = None,
    entropy: bool = False,
    token_weights: Float[Array, "batch seq"] | None = None,
) -> TokenScores:
    """The core of `token_logprobs` and of the training and policy losses.

    Under context parallelism (a mesh with `sp > 1`) the tokens run in the
    load-balanced ring order and the log-probabilities are put back in the original
    order. `chunk_size=None` is the naive baseline for benchmarks: full
    `[batch, seq, vocab]` logits with plain autodiff. `segment_ids`: packed
    documents (see `eqx_tx.Batch`). `entropy`: also compute each token's entropy
    (in the same LM-head chunks). `token_weights`: also compute
    `sum(token_weights * logprobs)` (`TokenScores.weighted_sum`), the cross-entropy
    objective, with its LM-head gradients taken in the forward pass.
    """
    B, T = input_ids.shape
    sp = context_parallel_size()
    order = None
    packed = () if segment_ids is None else (segment_ids, segment_positions(segment_ids))
    if sp > 1:
        weights = () if token_weights is None else (token_weights,)
        moved, positions, order = to_context_layout((input_ids, target_ids, *packed, *weights), sp)
        input_ids, target_ids, packed = moved[0], moved[1], tuple(moved[2 : 2 + len(packed)])
        token_weights = moved[-1] if weights else None
    else:
        positions = positions_for(B, T)
    segments, rope_positions = (constrain(x, ("batch", "seq")) for x in packed) if packed else (None, None)
    out = model.hidden_states(
        constrain(input_ids, ("batch", "seq")),
        positions=constrain(positions, ("batch", "seq")),
        mask=AttentionMask(lengths, 0, segments),
        compute=compute,
        rope_positions=rope_positions,
    )
    if chunk_size is None:
        logp_btv = jax.nn.log_softmax(model.head_logits(out.hidden), -1)
        logp = jnp.take_along_axis(logp_btv, target_ids[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_btv) * logp_btv, -1) if entropy else None
        weighted = None if token_weights is None else jnp.sum(jax.lax.stop_gradient(token_weights) * logp)
    else:
        logp, ent, weighted = chunked_scores(out.hidden, model.head_weight(), target_ids, chunk_size=chunk_size,
                                             entropy=entropy, token_weights=token_weights)
    if order is not None:  # back to the original token order
        logp, ent = (None if x is None else jnp.zeros_like(x).at[:, order].set(x)[:, :T] for x in (logp, ent))
    assert logp is not None
    return TokenScores(logp, ent, out.router_stats, weighted)


def token_logprobs(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    target_ids: Int[Array, "batch seq"],
    *,
    attention_mask: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compute: ComputeConfig = ComputeConfig(),
) -> Float[Array, "batch seq"]:
    """Log-probability of `target_ids[b, t]` given `input_ids[b, :t+1]`, float32.

    Differentiable; neither the forward nor the backward pass materialises
    `[batch, seq, vocab]` logits (see `chunked_logprobs`).

    **Arguments:**

    - `model`: the model.
    - `input_ids`: the inputs.
    - `target_ids`: the token to score at each position (usually inputs shifted by one).
    - `attention_mask`: right-padded 0/1 mask (default: no padding, or the non-zero
      `segment_ids`).
    - `segment_ids`: packed documents (`1..k` in order along the row, `0` padding):
      each document is scored as if it ran alone.
    - `chunk_size`: tokens per LM-head chunk.
    - `compute`: attention implementation and remat policy.

    **Returns:** `[batch, seq]` log-probabilities (values at padded positions are
    meaningless; weight them by zero).
    """
    B, T = input_ids.shape
    lengths, segment_ids = lengths_and_segments(attention_mask, segment_ids, T, B)
    return sequence_logprobs(model, input_ids, target_ids, lengths, compute=compute, chunk_size=chunk_size,
                             segment_ids=segment_ids).logprobs


def weighted_cross_entropy(
    logprobs: Float[Array, "batch seq"],
    weights: Float[Array, "batch seq"],
    *,
    normalizer: float | Float[Array, ""] | None = None,
) -> Float[Array, ""]:
    """`-sum(weights * logprobs) / normalizer`.

    `weights` is a 0/1 loss mask or real-valued per-token weights (e.g. RL
    advantages, possibly negative). The default `normalizer` is the number of tokens
    with a non-zero weight (at least 1), so with a 0/1 mask this is the mean token
    cross entropy; pass a constant to normalise otherwise (e.g. by a fixed token
    budget, so that every token weighs the same across batches).
    """
    weights = weights.astype(jnp.float32)
    if normalizer is None:
        normalizer = jnp.maximum(jnp.sum(weights != 0), 1)
    return -jnp.sum(weights * logprobs) / normalizer
