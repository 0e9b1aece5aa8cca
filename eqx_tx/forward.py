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

from .compute import ComputeConfig
from .layers.attention import AttentionMask
from .models import CausalLM
from .models.config import TransformerConfig
from .sharding import RULES, mesh_context, tree_shardings


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


@functools.partial(jax.jit, static_argnames="compute")
def _logits(model: CausalLM, input_ids, lengths, compute: ComputeConfig):
    B, T = input_ids.shape
    out = model.hidden_states(input_ids, positions=positions_for(B, T), mask=AttentionMask(lengths, 0), compute=compute)
    return model.head_logits(out.hidden)


def logits(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    attention_mask: Int[Array, "batch seq"] | None = None,
    *,
    compute: ComputeConfig = ComputeConfig(),
) -> Float[Array, "batch seq vocab"]:
    """Float32 logits of every position (for tests and small inputs).

    **Arguments:**

    - `model`: a `CausalLM` (possibly sharded; its mesh is used).
    - `input_ids`: token ids.
    - `attention_mask`: right-padded 0/1 mask; padded positions do not change the
      logits of real ones (their own logits are unspecified).
    - `compute`: attention implementation and remat policy.

    **Returns:** `[batch, seq, vocab]` float32 logits.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    B, T = input_ids.shape
    lengths = lengths_from_mask(attention_mask, T, B)
    with mesh_context(model):
        return _logits(model, input_ids, lengths, compute)


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
