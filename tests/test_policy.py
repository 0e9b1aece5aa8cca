"""Policy-gradient losses through the chunked LM head against a full-logits reference."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_tx
from eqx_tx.train.forward import logits_jit
from eqx_tx.train.policy import PolicyLoss

B, T = 4, 10
LENGTHS = [10, 7, 9, 10]
PROMPT = 3  # the first tokens of each sequence are prompt: weight 0
# Packed rows: documents 1..k in order, 0 on padding (row lengths as LENGTHS).
SEGMENTS = np.array([
    [1, 1, 1, 1, 2, 2, 2, 2, 2, 2],
    [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    [1, 1, 1, 1, 1, 2, 2, 2, 2, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
])


def _batch(model, *, packed: bool, seed: int = 0) -> eqx_tx.Batch:
    """Sampled-looking tokens: sampler log-probs near the model's own (ratios on both
    sides of the clip range), one advantage per sequence, groups of sequences."""
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    lengths = np.array(LENGTHS)
    real = np.arange(T)[None, :] < lengths[:, None]
    ids = np.where(real, rng.integers(0, V, (B, T)), 0).astype(np.int32)
    targets = np.roll(ids, -1, axis=1)
    segments = SEGMENTS if packed else real.astype(np.int32)
    starts = np.concatenate([np.ones((B, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    position = np.zeros((B, T), int)
    for b in range(B):
        for t in range(1, T):
            position[b, t] = 0 if starts[b, t] else position[b, t - 1] + 1
    weights = (real & (position >= PROMPT)).astype(np.float32)
    seq = segments + 10 * np.arange(B)[:, None]  # a distinct id per (row, document)
    per_seq = {s: rng.normal() for s in np.unique(seq)}
    advantages = np.vectorize(per_seq.get)(seq).astype(np.float32)
    groups = np.vectorize(lambda s: hash(int(s)) % 3)(seq).astype(np.int32)  # 3 groups, mixed over rows
    logp = np.asarray(_reference_scores(model, ids, targets, lengths, segments if packed else None)[0])
    return eqx_tx.Batch(
        input_ids=ids, target_ids=targets, loss_weights=weights, lengths=lengths.astype(np.int32),
        segment_ids=segments.astype(np.int32) if packed else None,
        sampler_logprobs=(logp + rng.normal(0.0, 0.3, (B, T))).astype(np.float32),
        advantages=advantages,
        reference_logprobs=(logp + rng.normal(0.0, 0.3, (B, T))).astype(np.float32),
        group_ids=groups,
    )


def _reference_scores(model, ids, targets, lengths, segments):
    """Log-prob of each target and entropy, from full [B, T, V] float32 logits."""
    logits = logits_jit(model, jnp.asarray(ids), jnp.asarray(lengths), eqx_tx.ComputeConfig(attention="xla"),
                     None if segments is None else jnp.asarray(segments))
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    logp = jnp.take_along_axis(logp_all, jnp.asarray(targets)[..., None], -1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, -1)


def _reference_loss(model, batch: eqx_tx.Batch, cfg: PolicyLoss):
    """The objective written out sequence by sequence (the papers' formulas)."""
    segments = batch.segment_ids
    logp, entropy = _reference_scores(model, batch.input_ids, batch.target_ids, batch.lengths, segments)
    w = np.asarray(batch.loss_weights)
    seg = np.asarray(segments) if segments is not None else (np.arange(T)[None, :] < batch.lengths[:, None])
    old, adv, ref = (jnp.asarray(x) for x in (batch.sampler_logprobs, batch.advantages, batch.reference_logprobs))
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    terms = {}  # (row, document) -> list of (weight, token loss, group, ratio)
    for b in range(B):
        for s in sorted(set(seg[b][seg[b] > 0].tolist())):
            idx = [t for t in range(T) if seg[b, t] == s and w[b, t] != 0]
            if not idx:
                continue
            lp = logp[b, jnp.array(idx)]
            if cfg.loss == "gspo":
                s_ratio = jnp.exp(jnp.mean(lp - old[b, jnp.array(idx)]))
                ratios = jax.lax.stop_gradient(s_ratio) * jnp.exp(lp - jax.lax.stop_gradient(lp))
            else:
                ratios = jnp.exp(lp - old[b, jnp.array(idx)])
            out = []
            for j, t in enumerate(idx):
                r, a = ratios[j], adv[b, t]
                if cfg.loss == "is":
                    l = -r * a
                elif cfg.loss == "cispo":
                    l = -jax.lax.stop_gradient(jnp.clip(r, lo, hi)) * a * lp[j]
                else:
                    l = -jnp.minimum(r * a, jnp.clip(r, lo, hi) * a)
                d = ref[b, t] - lp[j]
                l = l + cfg.kl_coef * (jnp.exp(d) - d - 1) - cfg.entropy_coef * entropy[b, t]
                out.append((w[b, t], l, int(batch.group_ids[b, t]), r))
            terms[(b, s)] = out
    tokens = [x for seq in terms.values() for x in seq]

    def mean(items):
        return sum(wt * l for wt, l, *_ in items) / sum(wt for wt, *_ in items)

    if cfg.normalise == "token":
        loss = mean(tokens)
    elif cfg.normalise == "sequence":
        loss = sum(mean(seq) for seq in terms.values()) / len(terms)
    elif cfg.normalise == "group":
        groups = {}
        for x in tokens:
            groups.setdefault(x[2], []).append(x)
        loss = sum(mean(g) for g in groups.values()) / len(groups)
    else:
        loss = sum(wt * l for wt, l, *_ in tokens) / cfg.normalise
    ratios = jnp.stack([r for *_, r in tokens])
    return loss, {"ratio": jnp.mean(ratios), "clip_fraction": jnp.mean((ratios < lo) | (ratios > hi))}


CASES = [  # (loss, normalise, kl_coef, entropy_coef, clip_high, packed)
    ("ppo", "token", 0.1, 0.01, 0.28, False),
    ("ppo", 37.0, 0.0, 0.0, 0.2, True),
    ("is", "sequence", 0.0, 0.0, 0.2, False),
    ("cispo", "group", 0.0, 0.05, 0.4, True),
    ("gspo", "sequence", 0.05, 0.0, 0.1, True),
]


@pytest.mark.parametrize("loss,normalise,kl_coef,entropy_coef,clip_high,packed", CASES)
def test_policy_loss_matches_full_logits_reference(checkpoints, loss, normalise, kl_coef, entropy_coef, clip_high,
                                                   packed):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    batch = _batch(model, packed=packed)
    cfg = PolicyLoss(loss, 0.2, clip_high, normalise, kl_coef, entropy_coef)

    @eqx.filter_jit
    def ours(model):
        return eqx_tx.policy_loss(model, batch, cfg, chunk_size=7)

    (value, metrics), grads = eqx.filter_value_and_grad(ours, has_aux=True)(model)
    (ref_value, ref_metrics), ref_grads = eqx.filter_value_and_grad(
        lambda m: _reference_loss(m, batch, cfg), has_aux=True)(model)
    assert 0.0 < ref_metrics["clip_fraction"] < 1.0 or loss == "is"  # both sides of the clip range are exercised
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio"], ref_metrics["ratio"], rtol=1e-5)
    if loss != "is":
        np.testing.assert_allclose(metrics["clip_fraction"], ref_metrics["clip_fraction"], rtol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = float(np.max(np.abs(r)))
        assert scale > 0, path
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_train_step_policy_loss_micro_batches(checkpoints):
    """`train_step` with a policy loss: its loss equals `policy_loss`, and 2 micro-batches
    give the same update and metrics as one batch."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    batch = _batch(model, packed=True, seed=1)
    policy = PolicyLoss("gspo", normalise="sequence", kl_coef=0.1, entropy_coef=0.01)
    expected, expected_metrics = eqx_tx.policy_loss(model, batch, policy)
    before = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    results = []
    for m in (1, 2):
        config = eqx_tx.TrainConfig(micro_batches=m, policy_loss=policy, loss_chunk_size=7)
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)  # the step donates
        state, metrics = eqx_tx.train_step(eqx_tx.init_train_state(fresh, config), batch, config)
        results.append((state.params, metrics))
        np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
        for name in ("policy_loss", "ratio", "clip_fraction", "sampler_kl", "kl", "entropy"):
            np.testing.assert_allclose(metrics[name], expected_metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)
    (one, _), (two, _) = results
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(one), before))  # the step did move


def test_policy_loss_memory_holds_no_logits_buffer():
    """Loss (with KL and entropy) and gradient at 8k tokens, vocab 32768: temp memory is
    far below one [B, T, V] f32 buffer and follows the LM-head chunk, not the tokens."""
    Bm, Tm, V = 2, 4096, 32768
    config = eqx_tx.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    model = eqx.filter_eval_shape(eqx_tx.CausalLM, config, key=jax.random.key(0))
    tok, f32 = jax.ShapeDtypeStruct((Bm, Tm), jnp.int32), jax.ShapeDtypeStruct((Bm, Tm), jnp.float32)
    batch = eqx_tx.Batch(tok, tok, f32, jax.ShapeDtypeStruct((Bm,), jnp.int32), None, f32, f32, f32)

    def temp(chunk_size):
        def grad(model, batch):
            return eqx.filter_grad(lambda m: eqx_tx.policy_loss(m, batch, PolicyLoss("ppo", kl_coef=0.1, entropy_coef=0.01),
                                                                chunk_size=chunk_size)[0])(model)

        return jax.jit(grad).lower(model, batch).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = Bm * Tm * V * 4
    small, large = temp(256), temp(1024)
    assert small < logits_bytes / 4, (small, logits_bytes)
    assert small < large / 2, (small, large)


def test_policy_loss_bad_inputs(checkpoints):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    batch = _batch(model, packed=False)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        eqx_tx.policy_loss(model, dataclasses.replace(batch, sampler_logprobs=None))
    with pytest.raises(ValueError, match=r"advantages has shape \(4, 9\)"):
        eqx_tx.policy_loss(model, dataclasses.replace(batch, advantages=batch.advantages[:, :9]))
    with pytest.raises(ValueError, match="reference_logprobs"):
        eqx_tx.policy_loss(model, dataclasses.replace(batch, reference_logprobs=None), PolicyLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match="group_ids must lie in"):
        eqx_tx.policy_loss(model, dataclasses.replace(batch, group_ids=batch.group_ids + B * T),
                           PolicyLoss(normalise="group"))
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        PolicyLoss("grpo")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="unknown normalise"):
        PolicyLoss(normalise="batch")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="constant normaliser"):
        PolicyLoss(normalise=0.0)
