"""`BankTrainer`: each slot of a LoRA bank trains as its own run. Gradients equal
`jax.grad` of the plain adapter's summed loss, the update equals PyTorch's
`torch.optim.AdamW` (with `clip_grad_norm_`) on the same gradients, other slots are
bit-for-bit untouched, and a low-rank slot stays low-rank."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_tx
from eqx_tx.layers.lora import lora_filter
from eqx_tx.models import Qwen3Config
from eqx_tx.train.bank_training import AdamWParams, BankTrainer, Datum
from eqx_tx.train.objectives import objective_config, token_losses

CONFIG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def trainer():
    base = eqx_tx.init_model(CONFIG, key=jax.random.key(0))
    bank = eqx_tx.apply_lora(base, rank=8, alpha=16.0, adapters=3, key=jax.random.key(1))
    trainer = BankTrainer(bank, min_row=16, tokens_per_call=32)  # several calls per request
    for slot in range(3):
        trainer.init_slot(slot, rank=8, seed=slot)
    # B = 0 would leave A without gradient: start from a trained-looking adapter
    trainer.params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(5), x.shape), trainer.params)
    return trainer


def _datums(seed: int, kind: str) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (5, 17, 9, 30):
        t = rng.integers(0, CONFIG.vocab_size, n + 1)
        out.append(Datum(t[:-1], t[1:], rng.uniform(0, 1, n).astype(np.float32),
                         rng.normal(-3, 0.5, n).astype(np.float32), rng.normal(0, 1, n).astype(np.float32),
                         (rng.uniform(0, 1, n) < 0.7).astype(np.float32)))
    return out


def _reference(trainer: BankTrainer, slot: int, datums, kind: str):
    """The slot as a plain adapter, the datums right-padded into one batch: the summed
    loss, its gradient, and each datum's log-probs."""
    single = eqx_tx.adapter_slot(trainer.model, slot)
    params, rest = eqx.partition(single, lora_filter(single))
    config = {k: jnp.asarray(v) for k, v in objective_config(kind, None).items()}
    T = max(len(d.tokens) for d in datums)

    def pad(field):
        return jnp.asarray(np.stack([np.pad(getattr(d, field), (0, T - len(d.tokens))) for d in datums]))

    mask = jnp.asarray([[1] * len(d.tokens) + [0] * (T - len(d.tokens)) for d in datums])
    rows = jnp.broadcast_to(jnp.arange(len(datums))[:, None], mask.shape)  # one datum per row

    def loss(p):
        lp = eqx_tx.token_logprobs(eqx.combine(p, rest), pad("tokens"), pad("targets"), attention_mask=mask)
        per = token_losses(kind, lp, mask.astype(jnp.float32), pad("weights"), pad("sampler_logprobs"),
                           pad("advantages"), config, ratio_mask=pad("ratio_mask"), sequence_ids=rows,
                           num_sequences=len(datums))
        return jnp.sum(per), lp

    (total, logps), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return float(total), [np.asarray(logps[i, :len(d.tokens)]) for i, d in enumerate(datums)], jax.tree.leaves(grads)


@pytest.mark.parametrize("kind", ["cross_entropy", "ppo", "gspo"])
def test_gradients_equal_the_plain_adapters_and_other_slots_stay_zero(trainer, kind):
    datums = _datums(1, kind)
    trainer.clear_gradients(1)
    logprobs, losses = trainer.forward_backward(1, datums, kind, objective_config(kind, None))
    total, want_logps, want_grads = _reference(trainer, 1, datums, kind)
    assert sum(float(np.sum(x)) for x in losses) == pytest.approx(total, rel=1e-5)
    for got, want in zip(logprobs, want_logps):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for g, want, axis in zip(jax.tree.leaves(trainer.grads), want_grads, trainer._axes):
        np.testing.assert_allclose(np.take(np.asarray(g), 1, axis=axis), want, atol=1e-5)
        for other in (0, 2):
            assert not np.any(np.take(np.asarray(g), other, axis=axis))
    trainer.clear_gradients(1)


def test_adamw_step_equals_torch_and_leaves_other_slots_bit_for_bit(trainer):
    datums = _datums(2, "cross_entropy")
    others = {s: trainer.slot_state(s) for s in (0, 2)}
    torch_params = [torch.nn.Parameter(torch.tensor(x)) for x in trainer.slot_state(1)["params"].values()]
    hp = AdamWParams(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)
    optimizer = torch.optim.AdamW(torch_params, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                  weight_decay=hp.weight_decay)
    for step in range(3):
        trainer.forward_backward(1, datums[step:], "cross_entropy", {})
        grads = [np.take(np.asarray(g), 1, axis=a) for g, a in zip(jax.tree.leaves(trainer.grads), trainer._axes)]
        for p, g in zip(torch_params, grads):
            p.grad = torch.tensor(g)
        want_norm = float(torch.nn.utils.clip_grad_norm_(torch_params, hp.grad_clip_norm))
        optimizer.step()
        norm = trainer.adamw_step(1, hp)
        assert norm == pytest.approx(want_norm, rel=1e-5)
        for got, want in zip(trainer.slot_state(1)["params"].values(), torch_params):
            np.testing.assert_allclose(got, want.detach().numpy(), atol=1e-6, rtol=1e-5)
    assert not any(np.any(np.take(np.asarray(g), 1, axis=a)) for g, a in zip(jax.tree.leaves(trainer.grads),
                                                                             trainer._axes))
    for slot, state in others.items():
        now = trainer.slot_state(slot)
        for part in state:
            for name in state[part]:
                np.testing.assert_array_equal(now[part][name], state[part][name])


def test_a_low_rank_slot_stays_low_rank_and_untrained_projections_stay_zero(trainer):
    trainer.init_slot(2, rank=3, train_attn=False, seed=7)
    for _ in range(2):
        trainer.forward_backward(2, _datums(3, "cross_entropy"), "cross_entropy", {})
        trainer.adamw_step(2, AdamWParams(learning_rate=1e-2))
    params = trainer.slot_state(2)["params"]
    assert trainer.counts[2] == 2
    for name, x in params.items():
        if any(f".{t}." in name for t in ("q_proj", "k_proj", "v_proj", "o_proj")):
            assert not np.any(x), name  # attention not trained: still exactly zero
        elif ".lora_A." in name:
            assert np.any(x[:, :3]) and not np.any(x[:, 3:]), name  # rows past rank 3: zero
        else:
            assert np.any(x[..., :3]) and not np.any(x[..., 3:]), name


def test_moments_kept_in_host_memory_give_the_same_steps(trainer):
    copy = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, trainer.model)
    offloaded = BankTrainer(copy, min_row=16, tokens_per_call=32, offload_moments=True)  # it owns its arrays
    assert offloaded.m is None  # no bank of moments on the device
    for t in (trainer, offloaded):
        t.init_slot(0, rank=8, seed=11)
    hp = AdamWParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
    for step in range(2):
        for t in (trainer, offloaded):
            t.forward_backward(0, _datums(4 + step, "cross_entropy"), "cross_entropy", {})
            t.adamw_step(0, hp)
    want, got = trainer.slot_state(0), offloaded.slot_state(0)
    for part in ("params", "m", "v"):
        for name in want[part]:
            np.testing.assert_allclose(got[part][name], want[part][name], rtol=1e-6, atol=1e-7)
    offloaded.set_slot(1, want, count=2)  # a loaded state lands in host memory too
    assert offloaded.counts[1] == 2 and np.array_equal(offloaded.slot_state(1)["m"][name], want["m"][name])


def test_remat_auto_chooses_a_policy_that_fits_and_scores_the_same(trainer, eqx_log):
    copy = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, trainer.model)
    auto = BankTrainer(copy, min_row=16, tokens_per_call=32,
                       compute=eqx_tx.ComputeConfig(remat="auto", memory_budget_gib=1.0))
    datums = _datums(6, "cross_entropy")[:2]
    want, _ = trainer.forward_backward(1, datums, "cross_entropy", {}, backward=False)
    got, _ = auto.forward_backward(1, datums, "cross_entropy", {}, backward=False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)
    assert any('remat="auto" chose' in m for m in eqx_log)
