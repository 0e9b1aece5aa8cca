"""Full-logits forward pass and model initialisation.

`logits` materialises `[batch, seq, vocab]` and exists for tests and small inputs;
training (`eqx_tx.token_logprobs`) and sampling (`eqx_tx.generate`) never call it.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..core.compute import ComputeConfig
from ..core.sharding import RULES, mesh_context, tree_shardings
from ..core.util import concrete_value
from ..kernels.mask import AttentionMask
from ..models import CausalLM
from ..models.config import TransformerConfig


def lengths_from_mask(attention_mask, seq_len: int, batch: int) -> Int[Array, " batch"]:
    """Per-sequence lengths of a right-padded 0/1 mask (checked when concrete)."""
    if attention_mask is None:
        return jnp.full((batch,), seq_len, jnp.int32)
    if attention_mask.shape != (batch, seq_len):
        raise ValueError(f"attention_mask shape {attention_mask.shape} != input_ids shape {(batch, seq_len)}")
    try:
        m = np.asarray(attention_mask) != 0
    except jax.errors.TracerArrayConversionError:  # traced: no check possible
        return jnp.sum(attention_mask != 0, axis=-1).astype(jnp.int32)
    lengths = m.sum(axis=-1)
    if not np.array_equal(m, np.arange(seq_len)[None, :] < lengths[:, None]):
        raise ValueError("attention_mask must be right-padded: ones, then zeros, in every row")
    return jnp.asarray(lengths, jnp.int32)


def positions_for(batch: int, seq_len: int) -> Int[Array, "batch seq"]:
    return jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))


def segment_positions(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """RoPE positions of packed documents: restarting at 0 wherever the id changes."""
    T = segment_ids.shape[-1]
    t = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def lengths_and_segments(attention_mask, segment_ids, seq_len: int, batch: int):
    """The per-sequence lengths (from the right-padded mask, else the non-zero segment
    ids, else full) and the checked int32 segment ids (or `None`)."""
    if attention_mask is None and segment_ids is not None:
        attention_mask = jnp.asarray(segment_ids) != 0
    lengths = lengths_from_mask(attention_mask, seq_len, batch)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
        check_segment_ids(segment_ids, lengths)
    return lengths, segment_ids


def check_segment_ids(segment_ids, lengths) -> None:
    """Raise unless each row's ids are positive and non-decreasing up to its length and
    0 after it (checked only when concrete and on this host)."""
    seg, lengths = concrete_value(segment_ids), concrete_value(lengths)
    if seg is None or lengths is None:
        return
    if seg.ndim != 2 or seg.shape[0] != lengths.shape[0]:
        raise ValueError(f"segment_ids shape {seg.shape} does not match {lengths.shape[0]} sequences")
    real = np.arange(seg.shape[1])[None, :] < lengths[:, None]
    if np.any(real & (seg <= 0)) or np.any(~real & (seg != 0)):
        raise ValueError("segment_ids must be >= 1 on the tokens of each row and 0 on its padding")
    if np.any(real[:, 1:] & (np.diff(seg, axis=1) < 0)):
        raise ValueError("segment_ids must be non-decreasing along each row (documents packed in order)")


@functools.partial(jax.jit, static_argnames="compute")
def logits_jit(model: CausalLM, input_ids, lengths, compute: ComputeConfig, segment_ids=None):
    """`logits` on key lengths `[batch]` (and segment ids), jitted: full float32 logits."""
    B, T = input_ids.shape
    rope = None if segment_ids is None else segment_positions(segment_ids)
    out = model.hidden_states(input_ids, positions=positions_for(B, T), mask=AttentionMask(lengths, 0, segment_ids),
                              compute=compute, rope_positions=rope)
    return model.head_logits(out.hidden)


def logits(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    attention_mask: Int[Array, "batch seq"] | None = None,
    *,
    segment_ids: Int[Array, "batch seq"] | None = None,
    compute: ComputeConfig = ComputeConfig(),
) -> Float[Array, "batch seq vocab"]:
    """Float32 logits of every position (for tests and small inputs).

    **Arguments:**

    - `model`: a `CausalLM` (possibly sharded; its mesh is used).
    - `input_ids`: token ids.
    - `attention_mask`: right-padded 0/1 mask; padded positions do not change the
      logits of real ones (their own logits are unspecified). Default: no padding,
      or the non-zero `segment_ids`.
    - `segment_ids`: packed documents (`1..k` in order along the row, `0` padding):
      each document's logits are those it has alone.
    - `compute`: attention implementation and remat policy.

    **Returns:** `[batch, seq, vocab]` float32 logits.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    B, T = input_ids.shape
    lengths, segment_ids = lengths_and_segments(attention_mask, segment_ids, T, B)
    with mesh_context(model):
        return logits_jit(model, input_ids, lengths, compute, segment_ids)


def init_model(
    config: TransformerConfig,
    *,
    key: PRNGKeyArray,
    dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    rules=RULES,
) -> CausalLM:
    """A randomly initialised model, created under `jit` directly in its shardings.

    Each device materialises only its own shard, in `dtype`; the eager constructor
    is never run, so large configs do not build every layer on one device.
    """
    abstract = eqx.filter_eval_shape(CausalLM, config, dtype=dtype, key=key)
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shardings = None if mesh is None else tree_shardings(params, mesh, rules)

    def make(k):
        return eqx.filter(CausalLM(config, dtype=dtype, key=k), eqx.is_array)

    arrays = jax.jit(make, out_shardings=shardings)(key)
    return eqx.combine(arrays, static)
