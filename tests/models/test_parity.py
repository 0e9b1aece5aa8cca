"""Every family against HF PyTorch: logits, gradients, remat policies, attention kernels."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_tx
from eqx_tx.io.hf_params import hf_tensors
from eqx_tx.train.forward import lengths_from_mask, logits_jit
from eqx_tx.train.remat_auto import remat_candidates
from tests.hf_utils import hf_logits, hf_model, per_expert, ragged_batch

LENGTHS = [11, 7, 3]


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_logits_match_hf_ragged(checkpoint, attention):
    name, path = checkpoint
    model = eqx_tx.load(path, dtype=jnp.float32, progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, LENGTHS)
    # Small blocks so the blockwise kernel really loops (and pads: 11 % 4 != 0).
    compute = eqx_tx.ComputeConfig(attention=attention, block_q=4, block_kv=4)
    ours = np.asarray(eqx_tx.logits(model, ids, mask, compute=compute))
    ref = hf_logits(path, ids, mask)
    real = mask.astype(bool)
    assert ours.shape == ref.shape
    assert ours.dtype == np.float32
    np.testing.assert_array_less(np.abs(ours - ref)[real].max(), 1e-4)


def test_padding_does_not_change_real_positions(checkpoints):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, [9, 5])
    full = np.asarray(eqx_tx.logits(model, ids, mask))
    alone = np.asarray(eqx_tx.logits(model, ids[1:, :5]))
    np.testing.assert_allclose(full[1, :5], alone[0], atol=1e-5)
    other_pad = ids.copy()
    other_pad[1, 5:] = 42  # different padding tokens
    np.testing.assert_allclose(np.asarray(eqx_tx.logits(model, other_pad, mask))[1, :5], full[1, :5], atol=1e-6)


def test_left_padded_mask_is_refused(checkpoints):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    ids, _ = ragged_batch(model.config.vocab_size, [4, 4])
    with pytest.raises(ValueError, match="right-padded"):
        eqx_tx.logits(model, ids, np.array([[0, 1, 1, 1], [1, 1, 1, 1]]))


def _mean_next_token_ce(model, ids, lengths, compute):
    logits = logits_jit(model, ids, lengths, compute)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    tgt = ids[:, 1:]
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    valid = jnp.arange(ids.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)


def _ours_grads(model, ids, mask, compute):
    lengths = lengths_from_mask(mask, ids.shape[1], ids.shape[0])
    loss, grads = eqx.filter_value_and_grad(_mean_next_token_ce)(model, jnp.asarray(ids), lengths, compute)
    out = {}
    for spec in hf_tensors(grads):
        for name, value in spec.items(spec.get(grads)):
            out[name] = value
    return float(loss), out


def _torch_grads(path, ids, mask):
    model = hf_model(path)
    model.train(False)
    t_ids = torch.as_tensor(ids, dtype=torch.long)
    t_mask = torch.as_tensor(mask, dtype=torch.long)
    logits = model(input_ids=t_ids, attention_mask=t_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, t_ids[:, 1:, None])[..., 0]
    valid = t_mask[:, 1:].bool()
    loss = (nll * valid).sum() / valid.sum()
    loss.backward()
    grads = per_expert({n: p.grad.numpy() for n, p in model.named_parameters()})
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)  # the same tensor as the embedding
    return loss.item(), grads


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_gradients_match_torch(checkpoint, attention):
    name, path = checkpoint
    model = eqx_tx.load(path, progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, LENGTHS, seed=1)
    compute = eqx_tx.ComputeConfig(attention=attention, block_q=4, block_kv=4)
    loss, ours = _ours_grads(model, ids, mask, compute)
    ref_loss, ref = _torch_grads(path, ids, mask)
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    assert set(ours) == set(ref)
    for key in ref:
        err = np.linalg.norm(ours[key] - ref[key]) / max(np.linalg.norm(ref[key]), 1e-12)
        assert err <= 1e-4, (key, err)


def test_remat_policy_does_not_change_results(checkpoints):
    """Every policy `remat="auto"` can choose (offload included), and `names`, equal `full`."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, LENGTHS, seed=2)
    auto = eqx_tx.ComputeConfig(attention="xla", remat="auto")
    policies = remat_candidates(auto) + [dataclasses.replace(auto, remat="names", remat_names=("attention", "mlp_hidden"))]
    base_loss, base = _ours_grads(model, ids, mask, dataclasses.replace(auto, remat="full"))
    for compute in policies:
        loss, grads = _ours_grads(model, ids, mask, compute)
        assert abs(loss - base_loss) <= 1e-6 * abs(base_loss), compute
        for key in base:
            err = np.linalg.norm(grads[key] - base[key]) / max(np.linalg.norm(base[key]), 1e-12)
            assert err <= 1e-6, (compute.remat, compute.remat_names, key, err)


def test_stacked_layers_have_leading_layer_axis(checkpoints):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    L = model.config.num_hidden_layers
    for leaf in jax.tree.leaves(eqx.filter(model.model.layers, eqx.is_array)):
        assert leaf.shape[0] == L
    assert model.model.layers.self_attn.q_proj.weight.shape == (L, 4, 16, 48)
