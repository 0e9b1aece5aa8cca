"""Micro-batches by token budget: packing keeps every sequence, and the step is unchanged."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_tx
from eqx_tx.train.token_budget import pack_by_tokens

LENGTHS = [40, 7, 12, 5, 30, 9]


def _batch(vocab: int) -> eqx_tx.Batch:
    rng = np.random.default_rng(0)
    B, T = len(LENGTHS), max(LENGTHS)
    real = np.arange(T)[None] < np.array(LENGTHS)[:, None]
    ids = np.where(real, rng.integers(0, vocab, (B, T)), 0).astype(np.int32)
    weights = (real & (np.arange(T)[None] >= 2)).astype(np.float32)
    noise = rng.normal(-2.0, 0.5, (B, T)).astype(np.float32)
    return eqx_tx.Batch(ids, np.roll(ids, -1, 1), weights, np.array(LENGTHS, np.int32),
                        sampler_logprobs=noise, advantages=np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32),
                        group_ids=np.repeat(np.arange(B)[:, None] // 2, T, 1).astype(np.int32))


def test_packing_keeps_every_sequence_once():
    b = _batch(97)
    packed, m = pack_by_tokens(b, 48, rows_multiple=2)
    assert m in (1, 2, 4) and packed.input_ids.shape == (2 * m, 48)
    assert int(packed.loss_weights.sum()) == int(b.loss_weights.sum())
    found = sorted(packed.input_ids[r, packed.segment_ids[r] == k].tolist() for r in range(2 * m)
                   for k in range(1, packed.segment_ids[r].max() + 1) if packed.loss_weights[r, packed.segment_ids[r] == k].any())
    assert found == sorted(b.input_ids[i, :n].tolist() for i, n in enumerate(LENGTHS))
    assert (packed.lengths <= 48).all()
    with pytest.raises(ValueError, match="a sequence of 40 tokens does not fit"):
        pack_by_tokens(b, 32)


@pytest.mark.parametrize("policy", [None, eqx_tx.PolicyLoss("gspo", normalise="sequence", kl_coef=0.0)])
def test_token_budget_step_equals_padded_step(checkpoints, policy):
    """One 40-token and five short sequences: packed into 48-token micro-batches, the
    step's loss and update equal the padded batch's."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    batch = _batch(model.config.vocab_size)
    results = []
    for budget in (None, 48):
        config = eqx_tx.TrainConfig(loss_chunk_size=7, policy_loss=policy, max_tokens_per_micro_batch=budget)
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
        state, metrics = eqx_tx.train_step(eqx_tx.init_train_state(fresh, config), batch, config)
        results.append((state.params, metrics))
    (plain, m_plain), (packed, m_packed) = results
    np.testing.assert_allclose(m_packed["loss"], m_plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(m_packed["grad_norm"], m_plain["grad_norm"], rtol=1e-5)
    assert int(m_packed["tokens"]) == int(m_plain["tokens"])
    # AdamW's first step moves every weight by about the learning rate (3e-4) whatever its gradient's
    # size, so a near-zero gradient's float noise shows up to a few % of it.
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(packed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        dataclasses.replace(eqx_tx.TrainConfig(), max_tokens_per_micro_batch=0)


class _TaggedBatch(eqx_tx.Batch):
    """A batch with one more per-token field, as a user would add one."""

    token_tags: np.ndarray | None = eqx.field(default=None, metadata={"per_token": True})


def test_a_new_per_token_field_is_packed_with_its_tokens():
    """Packing reads the per-token declaration: a field added by a subclass moves with
    its sequence's tokens (a hand-kept list of names would drop it)."""
    b = _batch(97)
    tags = np.where(np.asarray(b.loss_weights) > 0, np.asarray(b.input_ids) * 10 + 7, 0).astype(np.int32)
    tagged = _TaggedBatch(**{f.name: getattr(b, f.name) for f in dataclasses.fields(b)}, token_tags=tags)
    assert "token_tags" in tagged.per_token_fields()
    packed, _ = pack_by_tokens(tagged, 48, rows_multiple=2)
    assert isinstance(packed, _TaggedBatch) and packed.token_tags is not None
    # Every packed token carries the tag its token had before packing.
    real = packed.loss_weights > 0
    np.testing.assert_array_equal(packed.token_tags[real], packed.input_ids[real] * 10 + 7)
    assert int((packed.token_tags != 0).sum()) == int((tags != 0).sum())
