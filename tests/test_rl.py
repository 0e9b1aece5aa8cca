"""Rollouts to a policy-gradient batch: advantages, layout, the sampler's log-probs."""

import jax.numpy as jnp
import numpy as np
import pytest

import eqx_tx
from eqx_tx.core.util import length_bucket
from eqx_tx.rl import exact_match, final_answer, group_advantages, rollout_batch


def test_group_advantages():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 3.0, 0.0, 0.0]])
    got = group_advantages(r)
    for row, want in zip(got, r):
        centred = want - want.mean()
        np.testing.assert_allclose(row, centred / (want.std() + 1e-6), rtol=1e-5)
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_allclose(group_advantages(r, scale=False), r - r.mean(1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="groups, n"):
        group_advantages(np.zeros(4))


def test_rollout_batch_scores_the_answers_as_sampled(checkpoints):
    """The model's log-prob of each answer token in the batch equals the sampler's
    (ratio 1 on policy), and only answer tokens carry weight, advantage and group."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2]]
    n = 3
    gens = eqx_tx.generate(model, prompts, eqx_tx.SamplingParams(max_new_tokens=5, temperature=1.0, seed=4), n=n)
    adv = np.arange(9, dtype=np.float32).reshape(3, 3)
    b = rollout_batch(prompts, gens, adv, multiple=8)
    assert b.input_ids.shape[1] == length_bucket(max(len(prompts[i // n]) + len(g.tokens) for i, g in enumerate(gens))
                                                 - 1, 8)
    for i, g in enumerate(gens):
        p = prompts[i // n]
        answer = np.flatnonzero(b.loss_weights[i])
        np.testing.assert_array_equal(answer, np.arange(len(p) - 1, len(p) - 1 + len(g.tokens)))
        np.testing.assert_array_equal(b.target_ids[i, answer], g.tokens)
        np.testing.assert_array_equal(b.input_ids[i, : len(p)], p)
        np.testing.assert_array_equal(b.advantages[i, answer], adv[i // n, i % n])
        assert (b.group_ids[i] == i // n).all()
    mask = np.arange(b.input_ids.shape[1]) < b.lengths[:, None]
    logp = np.asarray(eqx_tx.token_logprobs(model, jnp.asarray(b.input_ids), jnp.asarray(b.target_ids),
                                            attention_mask=mask))
    real = b.loss_weights != 0
    np.testing.assert_allclose(logp[real], b.sampler_logprobs[real], atol=2e-5)
    with pytest.raises(ValueError, match="n answers"):
        rollout_batch(prompts, gens[:-1], adv)


@pytest.mark.parametrize("per_octave", [2, 4])
def test_length_buckets_are_few_and_waste_at_most_a_fraction(per_octave):
    """`length_bucket` against its definition, enumerated: the least `m * u` at or
    above the length, `u` in `1..per_octave` or `2**k * (1 + i / per_octave)` (with
    `per_octave=2`: `m * 2**k` or `m * 3 * 2**k`)."""
    p = per_octave
    for m in (8, 16):
        units = set(range(1, p + 1)) | {2**k + i * 2**k // p for k in range(12) if 2**k >= p for i in range(p)}
        candidates = sorted(m * u for u in units)
        if p == 2:
            assert candidates[:12] == sorted({m * f * 2**k for f in (1, 3) for k in range(12)})[:12]
        for n in range(1, 3000):
            assert length_bucket(n, m, per_octave=p) == next(c for c in candidates if c >= n), (n, m)
            assert n <= p * m or length_bucket(n, m, per_octave=p) <= (1 + 1 / p) * n + m
        assert len({length_bucket(n, m, per_octave=p) for n in range(1, 8193)}) <= p * (8192 // m).bit_length()
    with pytest.raises(ValueError, match="per_octave must be a power of two, got 3"):
        length_bucket(100, 16, per_octave=3)


def test_final_answer_and_exact_match():
    assert final_answer("so the sum is 12.") == "12"
    assert final_answer("work #### 42 ") == "42"
    assert final_answer(r"thus \boxed{7} and more 9") == "7"
    assert final_answer("   ") == ""
    assert exact_match("3+4 is 7", {"answer": 7}) == 1.0
    assert exact_match("17", {"answer": "7"}) == 0.0
