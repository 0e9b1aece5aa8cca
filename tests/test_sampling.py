"""The sort-free top-k/top-p filter against the sort-based reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_tx.sampling import (SamplerArrays, SamplingParams, candidate_window, filter_logits, filter_logits_batch,
                             sample_batch, sample_token)

V = 1000


def _assert_same_kept_set(logits, temperature, top_k, top_p, window):
    ref = np.asarray(jax.vmap(filter_logits)(logits, temperature, top_k, top_p))
    got = np.asarray(filter_logits_batch(logits, temperature, top_k, top_p, window=window))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    np.testing.assert_array_equal(np.where(np.isfinite(got), got, 0), np.where(np.isfinite(ref), ref, 0))


def _settings(rng, B, ks=(0, 1, 5, 20, 64, V), ps=(1e-7, 0.3, 0.9, 0.999, 1.0)):
    return (jnp.asarray(rng.choice([0.0, 0.5, 1.0, 2.0], B), jnp.float32), jnp.asarray(rng.choice(ks, B), jnp.int32),
            jnp.asarray(rng.choice(ps, B), jnp.float32))


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
        keys = [jax.random.fold_in(jax.random.fold_in(jax.random.key(i), 0), step) for i in range(B)]
        expected = [int(sample_token(logits[i], sampler.temperature[i], sampler.top_k[i], sampler.top_p[i], keys[i]))
                    for i in range(B)]
        assert np.asarray(tokens).tolist() == expected


def test_the_window_covers_every_top_k():
    assert candidate_window(0, 151936) == 64 and candidate_window(20, 151936) == 64
    assert candidate_window(65, 151936) == 128 and candidate_window(1000, 512) == 512
