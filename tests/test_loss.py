"""Chunked LM-head log-probabilities: values, gradients, memory."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_tx
from eqx_tx.io.hf_params import hf_tensors
from eqx_tx.train.forward import lengths_from_mask, logits_jit
from eqx_tx.train.loss import chunked_logprobs, chunked_scores, token_logprobs, weighted_cross_entropy
from tests.hf_utils import hf_model, ragged_batch

LENGTHS = [9, 6]  # batch*seq = 18 tokens


def _unchunked(model, ids, tgt, mask):
    lengths = lengths_from_mask(mask, ids.shape[1], ids.shape[0])
    logits = logits_jit(model, ids, lengths, eqx_tx.ComputeConfig())
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tgt[..., None], -1)[..., 0]


def _loss(logp_fn, model, ids, tgt, mask, w):
    return weighted_cross_entropy(logp_fn(model, ids, tgt, mask), w)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 512, 10_000])
def test_chunked_equals_unchunked_values_and_grads(checkpoints, chunk_size):
    _check_chunked(checkpoints["gqa_untied"], chunk_size)


def test_chunked_equals_unchunked_every_family(checkpoint):
    _check_chunked(checkpoint[1], 7)


def _check_chunked(path, chunk_size):
    model = eqx_tx.load(path, progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, LENGTHS, seed=4)
    ids = jnp.asarray(ids)
    tgt = jnp.roll(ids, -1, axis=1)
    w = jnp.asarray(mask, jnp.float32) * jnp.linspace(-1.0, 2.0, ids.shape[1])  # real-valued weights

    def chunked(model, ids, tgt, mask):
        return token_logprobs(model, ids, tgt, attention_mask=mask, chunk_size=chunk_size)

    real = np.asarray(mask, bool)
    ref = _unchunked(model, ids, tgt, mask)
    ours = jax.jit(chunked)(model, ids, tgt, mask)
    np.testing.assert_allclose(np.asarray(ours)[real], np.asarray(ref)[real], atol=1e-5)
    g = eqx.filter_jit(eqx.filter_grad(lambda m: _loss(chunked, m, ids, tgt, mask, w)))(model)
    g_ref = eqx.filter_grad(lambda m: _loss(_unchunked, m, ids, tgt, mask, w))(model)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_token_logprobs_match_hf_torch(checkpoints):
    path = checkpoints["gqa_untied"]
    model = eqx_tx.load(path, progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, LENGTHS, seed=5)
    tgt = np.roll(ids, -1, axis=1)
    w = mask.astype(np.float32)
    loss, grads = eqx.filter_value_and_grad(
        lambda m: weighted_cross_entropy(token_logprobs(m, jnp.asarray(ids), jnp.asarray(tgt), attention_mask=mask, chunk_size=7), jnp.asarray(w))
    )(model)
    ours = np.asarray(token_logprobs(model, jnp.asarray(ids), jnp.asarray(tgt), attention_mask=mask, chunk_size=7))

    hf = hf_model(path)
    logits = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits
    logp = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tgt, dtype=torch.long)[..., None])[..., 0]
    ref_loss = -(logp * torch.as_tensor(w)).sum() / torch.as_tensor(w).sum()
    ref_loss.backward()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], logp.detach().numpy()[real], atol=1e-5)
    assert abs(float(loss) - ref_loss.item()) < 1e-5
    ref_grads = dict(hf.named_parameters())
    for spec in hf_tensors(grads):
        for name, mine in spec.items(spec.get(grads)):
            np.testing.assert_allclose(mine, ref_grads[name].grad.numpy(), atol=1e-5, err_msg=name)


def test_weighted_cross_entropy_normalisation():
    logp = jnp.log(jnp.asarray([[0.5, 0.25, 0.1], [0.2, 0.9, 0.3]]))
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]])
    expected = -(np.log(0.5) + np.log(0.25) + np.log(0.2)) / 3
    np.testing.assert_allclose(weighted_cross_entropy(logp, mask), expected, rtol=1e-6)
    adv = jnp.asarray([[2.0, -1.0, 0.0], [0.5, 0.0, 0.0]])
    expected = -(2 * np.log(0.5) - np.log(0.25) + 0.5 * np.log(0.2)) / 3
    np.testing.assert_allclose(weighted_cross_entropy(logp, adv), expected, rtol=1e-6)
    np.testing.assert_allclose(weighted_cross_entropy(logp, adv, normalizer=10.0), expected * 3 / 10, rtol=1e-6)
    assert float(weighted_cross_entropy(logp, jnp.zeros_like(adv))) == 0.0


def test_chunked_loss_memory_below_one_logits_buffer():
    """Loss+grad at 8k tokens with a 32k vocab: temp < one [tokens, vocab] f32 buffer."""
    B, T, D, V = 2, 4096, 64, 32768
    hidden = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    weight = jax.ShapeDtypeStruct((V, D), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, T), jnp.int32)
    logits_bytes = B * T * V * 4

    def loss(hidden, weight, targets, chunk_size):
        return -jnp.sum(chunked_logprobs(hidden, weight, targets, chunk_size=chunk_size))

    def temp(chunk_size):
        f = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
        return f.lower(hidden, weight, targets, chunk_size).compile().memory_analysis().temp_size_in_bytes

    chunked, smaller, unchunked = temp(1024), temp(256), temp(B * T)
    assert chunked < logits_bytes / 2, (chunked, logits_bytes)
    assert smaller < chunked / 2  # memory follows the chunk, not the token count
    assert unchunked > logits_bytes  # the same code without chunking does hold the logits


def _head_problem(seed: int):
    """Random hidden states `[2, 13, 8]`, a head `[50, 8]`, targets, and two random
    per-token coefficient arrays."""
    k = jax.random.split(jax.random.key(seed), 5)
    B, T, D, V = 2, 13, 8, 50
    hidden, weight = jax.random.normal(k[0], (B, T, D)), jax.random.normal(k[1], (V, D))
    targets = jax.random.randint(k[2], (B, T), 0, V)
    return hidden, weight, targets, jax.random.normal(k[3], (B, T)), jax.random.normal(k[4], (B, T))


@pytest.mark.parametrize("chunk_size", [1, 5, 26, 100])
def test_chunked_entropy_values_and_grads(chunk_size):
    """Entropy from the chunks (and the gradient through log-probs and entropy together)
    equals full-softmax autodiff; an unused entropy output leaves the gradient as it was."""
    hidden, weight, targets, a, b = _head_problem(0)

    def reference(hidden, weight):
        logp = jax.nn.log_softmax(hidden @ weight.T, -1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], -jnp.sum(jnp.exp(logp) * logp, -1)

    def ours(hidden, weight):
        return chunked_scores(hidden, weight, targets, chunk_size=chunk_size, entropy=True)

    for x, y in zip(ours(hidden, weight), reference(hidden, weight)):
        np.testing.assert_allclose(x, y, atol=1e-5)
    for a_coef, b_coef in ((a, b), (a, 0.0)):
        def objective(fn):
            return lambda h, w: jnp.sum(a_coef * fn(h, w)[0]) + jnp.sum(b_coef * fn(h, w)[1])

        got = jax.jit(jax.grad(objective(ours), argnums=(0, 1)))(hidden, weight)
        want = jax.grad(objective(reference), argnums=(0, 1))(hidden, weight)
        for x, y in zip(got, want):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-5)


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(jnp.zeros((1, 2, 4)), jnp.zeros((8, 4)), jnp.zeros((1, 2), jnp.int32), chunk_size=0)


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_weighted_sum_gradients_come_from_the_forward_pass(chunk_size):
    """`token_weights`: `sum(w * logp)` and its gradients (taken in the forward pass)
    equal plain autodiff of full logits, alone, with the head weight frozen, and
    together with per-token cotangents (which take the second pass); the gradient of
    the weighted sum alone runs three vocabulary-sized matmuls, not four."""
    hidden, weight, targets, w, a = _head_problem(1)
    V = weight.shape[0]

    def reference(hidden, weight):
        logp = jax.nn.log_softmax(hidden @ weight.T, -1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]

    def ours(hidden, weight):
        logp, _, weighted = chunked_scores(hidden, weight, targets, chunk_size=chunk_size, token_weights=w)
        return logp, weighted

    np.testing.assert_allclose(ours(hidden, weight)[1], jnp.sum(w * reference(hidden, weight)), rtol=1e-5)
    cases = {
        "weighted sum": (lambda h, v: ours(h, v)[1], lambda h, v: jnp.sum(w * reference(h, v))),
        "and per-token": (lambda h, v: (lambda o: o[1] + jnp.sum(a * o[0]))(ours(h, v)),
                          lambda h, v: jnp.sum((w + a) * reference(h, v))),
    }
    for name, (got_fn, want_fn) in cases.items():
        for argnums in ((0, 1), (0,)):
            got = jax.jit(jax.grad(got_fn, argnums=argnums))(hidden, weight)
            want = jax.grad(want_fn, argnums=argnums)(hidden, weight)
            for x, y in zip(got, want):
                np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-5, err_msg=f"{name}, argnums {argnums}")

    def vocab_dots(fn, transform=lambda f: jax.grad(f, argnums=(0, 1))):
        jaxpr = jax.make_jaxpr(transform(fn))(hidden, weight)
        found = []

        def walk(jx):
            for eqn in jx.eqns:
                if eqn.primitive.name == "dot_general" and any(V in v.aval.shape for v in [*eqn.invars, *eqn.outvars]):
                    found.append(eqn)
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr.jaxpr)
        return len(found)

    assert vocab_dots(cases["weighted sum"][0], transform=lambda f: f) == 1  # no gradient: logits only
    assert vocab_dots(cases["weighted sum"][0]) == 3
    assert vocab_dots(cases["weighted sum"][0], transform=lambda f: jax.grad(f)) == 2  # frozen head: no d_weight
    assert vocab_dots(cases["and per-token"][0]) == 6  # the second pass: logits again, d_hidden, d_weight
