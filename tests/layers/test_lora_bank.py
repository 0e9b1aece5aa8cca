"""A bank of LoRA adapters in one batch equals each adapter run alone."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_tx
from eqx_tx.train.training import _coefficients, loss_and_grads
from tests.hf_utils import ragged_batch
from tests.lora_util import perturbed_adapters

ADAPTERS = 4
ROW_ADAPTERS = np.array([2, 0, 2, 1, 0, 2])  # adapter 3 is not in the batch
LENGTHS = [9, 6, 8, 9, 5, 7]


def _bank(path):
    """A 4-adapter bank whose adapters all differ (B randomised: it starts at zero)."""
    model = eqx_tx.load(path, progress=False)
    bank = eqx_tx.apply_lora(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"),
                             adapters=ADAPTERS, key=jax.random.key(1))
    return perturbed_adapters(bank, jax.random.key(2))


def _batch(vocab, rows=slice(None)) -> eqx_tx.Batch:
    ids, mask = ragged_batch(vocab, LENGTHS, seed=3)
    weights = mask.astype(np.float32)
    weights[:, :2] = 0.0  # a prompt
    return eqx_tx.Batch(ids[rows], np.roll(ids, -1, 1)[rows], weights[rows], mask.sum(1).astype(np.int32)[rows],
                        adapter_ids=ROW_ADAPTERS[rows].astype(np.int32))


def _alone(batch: eqx_tx.Batch) -> eqx_tx.Batch:
    return dataclasses.replace(batch, adapter_ids=None)


def _padded(batch: eqx_tx.Batch, rows: int) -> eqx_tx.Batch:
    """`batch` with rows of zero loss weight appended up to `rows` (so fewer shapes
    compile; a zero-weight row changes no loss, gradient or normalisation)."""
    extra = rows - batch.input_ids.shape[0]
    pad = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[:1], extra, 0)]), batch)
    weights = np.asarray(pad.loss_weights).copy()
    weights[rows - extra :] = 0.0
    return dataclasses.replace(pad, loss_weights=weights)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def test_bank_logits_equal_each_adapter_alone(checkpoints):
    bank = _bank(checkpoints["gqa_untied"])
    b = _batch(bank.config.vocab_size)
    mask = np.arange(b.input_ids.shape[1]) < b.lengths[:, None]
    together = eqx_tx.logits(eqx_tx.select_adapters(bank, b.adapter_ids), b.input_ids, attention_mask=mask)
    base = eqx_tx.logits(eqx_tx.layers.lora.without_adapters(bank), b.input_ids)
    for row, k in enumerate(ROW_ADAPTERS):
        n = LENGTHS[row]  # (each row alone at the batch's padded length: one shape to compile)
        alone = eqx_tx.logits(eqx_tx.adapter_slot(bank, int(k)), b.input_ids[row : row + 1],
                              attention_mask=mask[row : row + 1])
        np.testing.assert_allclose(together[row, :n], alone[0, :n], atol=1e-5)
        assert np.max(np.abs(np.asarray(together[row, :n] - base[row, :n]))) > 1e-2  # the adapter does act


def test_bank_gradients_and_adamw_steps_equal_separate_runs(checkpoints):
    """Gradients, then two AdamW steps (the second without adapter 1's rows): each adapter
    moves exactly as in its own run; adapter 3, never in a batch, is untouched."""
    bank = _bank(checkpoints["gqa_untied"])
    V = bank.config.vocab_size
    config = eqx_tx.TrainConfig(
        optimizer=eqx_tx.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=10, weight_decay=0.1,
                                         max_grad_norm=0.05),  # clipping acts, per adapter
        loss_chunk_size=7,
    )
    batches = [_batch(V), _padded(_batch(V, np.flatnonzero(ROW_ADAPTERS != 1)), len(ROW_ADAPTERS))]

    # gradients of the first batch: the bank's slot k equals adapter k's own gradient
    state = eqx_tx.init_train_state(bank, config)
    b = jax.tree.map(jnp.asarray, batches[0])
    coefficients = _coefficients(b, config, ADAPTERS)
    _, grads = jax.jit(loss_and_grads, static_argnums=4)(state.params, state.frozen, b, coefficients, config,
                                                          jnp.float32(1))
    grads = eqx.combine(grads, state.frozen)
    for k in range(3):
        single = eqx_tx.init_train_state(eqx_tx.adapter_slot(bank, k), config)
        rows = jax.tree.map(jnp.asarray, _alone(_padded(_batch(V, np.flatnonzero(ROW_ADAPTERS == k)), 3)))
        c = _coefficients(rows, config, None)
        _, g = jax.jit(loss_and_grads, static_argnums=4)(single.params, single.frozen, rows, c, config, jnp.float32(1))
        mine = eqx.filter(eqx_tx.adapter_slot(grads, k), eqx.is_array)
        for x, y in zip(jax.tree.leaves(eqx.filter(mine, eqx_tx.layers.lora.lora_filter(mine))), jax.tree.leaves(g)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)

    # two steps of the bank vs each adapter's own run on its rows
    state = eqx_tx.init_train_state(_copy(bank), config)
    for batch in batches:
        state, _ = eqx_tx.train_step(state, batch, config)
    trained = state.model
    for k in range(ADAPTERS):
        single = eqx_tx.init_train_state(eqx_tx.adapter_slot(_copy(bank), k), config)
        for batch in batches:
            rows = np.flatnonzero((batch.adapter_ids == k) & batch.loss_weights.any(1))
            if len(rows):
                mine = _padded(jax.tree.map(lambda x: x[rows], batch), 3)
                single, _ = eqx_tx.train_step(single, _alone(mine), config)
        ours = eqx_tx.adapter_slot(trained, k)
        steps = int(sum(np.any((b.adapter_ids == k) & b.loss_weights.any(1)) for b in batches))
        assert steps == {0: 2, 1: 1, 2: 2, 3: 0}[k]
        for x, y, start in zip(*(jax.tree.leaves(eqx.filter(m, eqx_tx.layers.lora.lora_filter(m)))
                                 for m in (ours, single.model, eqx_tx.adapter_slot(bank, k)))):
            # (AdamW's first steps move each weight by about lr = 1e-2 whatever the gradient's
            # size, so rounding differences in a tiny gradient show at ~1e-6.)
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
            if steps == 0:
                np.testing.assert_array_equal(x, start)
    counts = [x for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.int32 and x.shape == (ADAPTERS,)]
    assert counts and all(list(c) == [2, 1, 2, 0] for c in counts)


def test_bank_adapters_save_and_load_one_by_one(checkpoints, tmp_path):
    bank = _bank(checkpoints["gqa_untied"])
    eqx_tx.save_adapter(bank, tmp_path / "one", slot=1)
    loaded = eqx_tx.load_adapter(bank, tmp_path / "one", slot=3)
    for x, y in zip(jax.tree.leaves(eqx_tx.adapter_slot(loaded, 3)), jax.tree.leaves(eqx_tx.adapter_slot(bank, 1))):
        np.testing.assert_array_equal(x, y)
    for k in (0, 1, 2):  # the other slots are as they were
        for x, y in zip(jax.tree.leaves(eqx_tx.adapter_slot(loaded, k)), jax.tree.leaves(eqx_tx.adapter_slot(bank, k))):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="pass slot="):
        eqx_tx.save_adapter(bank, tmp_path / "two")
    other = eqx_tx.apply_lora(eqx_tx.load(checkpoints["gqa_untied"], progress=False), rank=2, alpha=8.0,
                              key=jax.random.key(0))
    eqx_tx.save_adapter(other, tmp_path / "rank2")
    with pytest.raises(ValueError, match="does not fit the bank"):
        eqx_tx.load_adapter(bank, tmp_path / "rank2", slot=0)

    # A bank from PEFT directories, slot 0 the base itself (B = 0).
    eqx_tx.save_adapter(bank, tmp_path / "two", slot=2)
    base = eqx_tx.layers.lora.without_adapters(bank)
    built = eqx_tx.load_adapter_bank(base, [tmp_path / "one", tmp_path / "two"], base_slot=True)
    assert eqx_tx.layers.lora.lora_settings(built)["adapters"] == 3
    lora = eqx_tx.layers.lora.LoRALinear
    zero = [n.lora_B.weight for n in jax.tree.leaves(eqx_tx.adapter_slot(built, 0), is_leaf=lambda x: isinstance(x, lora))
            if isinstance(n, lora)]
    assert zero and not any(np.any(np.asarray(w)) for w in zero)
    for slot, source in ((1, 1), (2, 2)):
        for x, y in zip(jax.tree.leaves(eqx_tx.adapter_slot(built, slot)), jax.tree.leaves(eqx_tx.adapter_slot(bank, source))):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="one bank needs the same targets, rank and alpha"):
        eqx_tx.load_adapter_bank(base, [tmp_path / "one", tmp_path / "rank2"])


def test_bank_needs_adapter_ids(checkpoints):
    bank = _bank(checkpoints["gqa_untied"])
    config = eqx_tx.TrainConfig()
    state = eqx_tx.init_train_state(bank, config)
    b = _batch(bank.config.vocab_size)
    with pytest.raises(ValueError, match="adapter_ids must name each sequence"):
        eqx_tx.train_step(state, _alone(b), config)
    with pytest.raises(ValueError, match=r"adapter_ids must lie in \[0, 4\)"):
        eqx_tx.train_step(state, dataclasses.replace(b, adapter_ids=b.adapter_ids + 2), config)
    with pytest.raises(ValueError, match="choose one per sequence"):
        eqx_tx.logits(bank, b.input_ids)


def test_bank_generate_equals_each_adapter_alone(checkpoints):
    """Each prompt sampled with its own adapter (greedy and seeded), in one batch, gives
    the tokens and log-probs of that adapter's model run on the prompt alone; with
    `n = 2` samples sharing each prompt's cache (prefill rows: prompts; decode rows:
    samples)."""
    n, share_prefix = 2, True
    bank = _bank(checkpoints["gqa_untied"])
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2], [1, 2, 3]]
    adapters = [2, 0, 1, 2]
    params = [eqx_tx.SamplingParams(max_new_tokens=6, temperature=0.0),
              eqx_tx.SamplingParams(max_new_tokens=4, temperature=1.0, seed=3),
              eqx_tx.SamplingParams(max_new_tokens=6, temperature=0.8, top_k=10, seed=5),
              eqx_tx.SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=7)]
    together = eqx_tx.generate(bank, prompts, params, n=n, share_prefix=share_prefix, adapters=adapters)
    for i, (prompt, k, sp) in enumerate(zip(prompts, adapters, params)):
        alone = eqx_tx.generate(eqx_tx.adapter_slot(bank, k), [prompt], sp, n=n, share_prefix=share_prefix)
        for j in range(n):
            got, want = together[i * n + j], alone[j]
            assert got.tokens == want.tokens, (i, j)
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="adapters must name each sequence"):
        eqx_tx.generate(bank, prompts, params)


def test_bank_on_row_groups_laid_out_as_one_row_equals_each_group():
    """A bank layer called on groups of rows laid out as one row (`eqx_tx.core.ragged`:
    the engine's prefill chunk and decode rows in one pass) gives each row what its own
    group's call gives, with its own adapter."""
    from eqx_tx.core.ragged import join_tokens, split_tokens
    from eqx_tx.layers.linear import Linear
    from eqx_tx.layers.lora import AdapterSelection, LoRABank

    base = Linear(16, (2, 8), axes=("heads", "head_dim", "embed"), key=jax.random.key(0))
    layer = LoRABank(base, adapters=3, rank=4, alpha=8.0, key=jax.random.key(1))
    b = jax.random.normal(jax.random.key(2), layer.lora_B.weight.shape)
    layer = eqx.tree_at(lambda m: m.lora_B.weight, layer, b)
    groups = ((2, 5), (3, 1))
    ids = jnp.array([2, 0, 1, 2, 0])
    x = jax.random.normal(jax.random.key(3), (1, 13, 16))

    def call(selection, x):
        return eqx.tree_at(lambda m: m.selection, layer, selection, is_leaf=lambda s: s is None)(x)

    together = call(AdapterSelection(ids, groups), x)
    parts = [call(AdapterSelection(ids[:2]), x_g) for x_g in split_tokens(x, groups)[:1]]
    parts.append(call(AdapterSelection(ids[2:]), split_tokens(x, groups)[1]))
    np.testing.assert_allclose(together, join_tokens(parts), rtol=1e-6, atol=1e-6)
    assert together.shape == (1, 13, 2, 8)
    for row, k in ((0, 2), (1, 0)):  # each prefill row with its own adapter, not another's
        other = call(AdapterSelection(jnp.full((2,), (k + 1) % 3)), split_tokens(x, groups)[0])
        assert np.max(np.abs(np.asarray(parts[0][row] - other[row]))) > 1e-3
