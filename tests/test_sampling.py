"""The sort-free top-k/top-p filter against the sort-based reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_tx.infer.sampling import (
    SamplerArrays,
    SamplingParams,
    candidate_window,
    filter_logits,
    filter_logits_batch,
    sample_batch,
    sample_token,
    token_gumbel,
)

V = 1000


def _assert_same_kept_set(logits, temperature, top_k, top_p, window):
    ref = np.asarray(jax.vmap(filter_logits)(logits, temperature, top_k, top_p))
    got = np.asarray(filter_logits_batch(logits, temperature, top_k, top_p, window=window))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    np.testing.assert_array_equal(np.where(np.isfinite(got), got, 0), np.where(np.isfinite(ref), ref, 0))


def _settings(rng, B, ks=(0, 1, 5, 20, 64, V), ps=(1e-7, 0.3, 0.9, 0.999, 1.0)):
    return (jnp.asarray(rng.choice([0.0, 0.5, 1.0, 2.0], B), jnp.float32), jnp.asarray(rng.choice(ks, B), jnp.int32),
            jnp.asarray(rng.choice(ps, B), jnp.float32))


def _reference_tokens(logits, sampler, step):
    """`sample_token` on each row with the key `sample_batch` uses for token `step` (sample 0)."""
    B = logits.shape[0]
    keys = [jax.random.fold_in(jax.random.fold_in(jax.random.key(int(sampler.seed[i])), 0), step) for i in range(B)]
    return [int(sample_token(logits[i], sampler.temperature[i], sampler.top_k[i], sampler.top_p[i], keys[i]))
            for i in range(B)]


@pytest.mark.parametrize("seed", range(6))
def test_kept_set_equals_the_sorting_reference(seed):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(16, V)) * rng.uniform(0.05, 6), jnp.float32)  # flat to peaked
    t, k, p = _settings(rng, 16)
    _assert_same_kept_set(logits, t, k, p, candidate_window(int(k.max()), V))


def test_ties_at_the_threshold_and_minus_infinity():
    rng = np.random.default_rng(7)
    logits = np.round(rng.normal(size=(8, V)), 1).astype(np.float32)  # many ties
    logits[:, ::7] = -np.inf
    logits[0] = 0.0  # all tied: top_p keeps them all
    logits[1, :10] = 5.0  # ten tied at the top, top_k = 3 keeps all ten
    k = jnp.asarray([0, 3, 1, 10, 0, V, 64, 2], jnp.int32)
    p = jnp.asarray([0.5, 1.0, 0.9, 0.99, 0.999, 0.2, 0.7, 1e-7], jnp.float32)
    _assert_same_kept_set(jnp.asarray(logits), jnp.ones(8), k, p, window=candidate_window(V, V))


def test_a_top_p_set_larger_than_the_window_is_found_by_bisection():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 0.05  # nearly flat: top_p 0.9 keeps ~900
    logits[3, :100] = 1.0  # 100 tied at the top: top_k 3 keeps all of them, past the window
    logits = jnp.asarray(logits)
    k, p = jnp.asarray([0, 0, 40, 3], jnp.int32), jnp.asarray([0.9, 0.5, 0.95, 0.99], jnp.float32)
    kept = np.isfinite(np.asarray(filter_logits_batch(logits, jnp.ones(4), k, p, window=64))).sum(-1)
    assert kept[0] > 64 and kept[1] > 64 and kept[3] == 100  # beyond the window
    _assert_same_kept_set(logits, jnp.ones(4), k, p, window=64)


def test_sampled_tokens_equal_the_reference_for_the_same_keys():
    rng = np.random.default_rng(11)
    B = 12
    logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), seed=i)
              for i, (t, k, p) in enumerate(zip(*(np.asarray(a) for a in _settings(rng, B))))]
    sampler = SamplerArrays.from_params(params, (), V)
    for step in range(4):
        index = jnp.full((B,), step, jnp.int32)
        tokens, _ = jax.jit(sample_batch)(logits, sampler, index)
        expected = _reference_tokens(logits, sampler, step)
        assert np.asarray(tokens).tolist() == expected


def test_the_window_covers_every_top_k():
    assert candidate_window(0, 151936) == 64 and candidate_window(20, 151936) == 64
    assert candidate_window(65, 151936) == 128 and candidate_window(1000, 512) == 512


@pytest.mark.parametrize("peak", [1.0, 4.0])
def test_draws_from_the_window_alone_equal_the_reference(peak):
    """Every row's kept set inside the window (top-k, or top-p reached there): only
    the candidates' noise is computed, and the token is the one drawn from the whole
    vocabulary with the same key."""
    rng = np.random.default_rng(5)
    B = 8
    logits = jnp.asarray(rng.normal(size=(B, V)) * peak, jnp.float32)
    ks = [1, 5, 20, 20, 64, 0, 3, 0]
    ps = [1.0, 0.9, 0.95, 0.3, 0.5, 1e-7, 1.0, 0.2 if peak > 1 else 1e-7]
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=p, seed=i) for i, (k, p) in enumerate(zip(ks, ps))]
    sampler = SamplerArrays.from_params(params, (), V)
    for step in range(8):
        index = jnp.full((B,), step, jnp.int32)
        tokens, logp = jax.jit(sample_batch)(logits, sampler, index)
        expected = _reference_tokens(logits, sampler, step)
        assert np.asarray(tokens).tolist() == expected
        ref_logp = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(B), expected]
        np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-5, atol=1e-6)


def test_token_noise_depends_only_on_key_and_id():
    key = jax.random.key(42)
    ids = jnp.arange(V, dtype=jnp.int32)
    whole = np.asarray(token_gumbel(key, ids))
    picked = np.asarray(token_gumbel(key, jnp.asarray([17, 3, 999, 500], jnp.int32)))
    np.testing.assert_array_equal(picked, whole[[17, 3, 999, 500]])
    # Standard Gumbel: mean = Euler's gamma, variance = pi^2 / 6 (V = 1000 draws).
    assert abs(whole.mean() - 0.5772) < 0.15 and abs(whole.var() - np.pi**2 / 6) < 0.5


def test_draws_past_the_window_equal_the_reference():
    """Rows whose kept set may reach past the window (no filter in a filtered batch,
    a flat top-p set, ties at the top-k threshold): the whole vocabulary is drawn from."""
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    logits[1] *= 0.05  # flat: top_p 0.9 keeps ~900 tokens
    logits[2, :100] = 8.0  # 100 tied at the top: top_k 3 keeps all of them
    logits = jnp.asarray(logits)
    params = [SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=3, seed=2), SamplingParams(temperature=0.7, top_k=20, seed=3)]
    sampler = SamplerArrays.from_params(params, (), V)
    assert sampler.window == 64
    for step in range(6):
        tokens, _ = jax.jit(sample_batch)(logits, sampler, jnp.full((4,), step, jnp.int32))
        expected = _reference_tokens(logits, sampler, step)
        assert np.asarray(tokens).tolist() == expected
        assert int(tokens[2]) < 100
