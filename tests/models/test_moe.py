"""Qwen3-MoE specifics: router logits and load-balancing loss against HF, expert
parallelism, no dense [tokens, experts, hidden] buffer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqx_tx
from eqx_tx.kernels.mask import AttentionMask
from eqx_tx.layers.lora import apply_lora
from eqx_tx.train.forward import positions_for
from tests.hf_utils import hf_model, ragged_batch


@pytest.fixture(scope="module")
def moe_path(checkpoints):
    return checkpoints["qwen3_moe"]


def test_router_logits_layer_outputs_and_aux_loss_match_hf(moe_path):
    model = eqx_tx.load(moe_path, progress=False)
    hf = hf_model(moe_path)
    ids, mask = ragged_batch(model.config.vocab_size, [12, 7], seed=2)
    captured = {}
    hooks = [layer.mlp.register_forward_hook(lambda mod, inp, out, i=i: captured.__setitem__(i, (inp[0], out)))
             for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                 output_router_logits=True)
    for h in hooks:
        h.remove()
    layers = model.model.layers
    for i, router_logits in enumerate(out.router_logits):
        moe = jax.tree.map(lambda x: x[i], layers.mlp)  # this layer's MoE block
        x = jnp.asarray(captured[i][0].numpy())
        ours_logits = moe.route(x.reshape(-1, x.shape[-1]))[0]
        np.testing.assert_allclose(ours_logits, router_logits.numpy(), atol=1e-5)
        y, _ = moe(x)
        np.testing.assert_allclose(y, captured[i][1].numpy(), atol=1e-5)
    lengths = jnp.asarray(mask.sum(-1))
    stats = model.hidden_states(jnp.asarray(ids), positions=positions_for(*ids.shape),
                                mask=AttentionMask(lengths, 0), compute=eqx_tx.ComputeConfig()).router_stats
    np.testing.assert_allclose(float(stats.load_balancing_loss()), float(out.aux_loss), rtol=1e-5)


def test_train_step_adds_the_load_balancing_loss(moe_path):
    from eqx_tx.train.training import Batch, TrainConfig, init_train_state, train_step

    model = apply_lora(eqx_tx.load(moe_path, progress=False), rank=2, alpha=4.0,
                       targets=("q_proj", "o_proj"), key=jax.random.key(0))
    ids, _ = ragged_batch(model.config.vocab_size, [9, 9], seed=3)
    batch = Batch(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.ones((2, 8)), jnp.full((2,), 8))
    state, metrics = train_step(init_train_state(model, TrainConfig()), batch, TrainConfig())
    assert float(metrics["load_balancing_loss"]) > 0.5  # ~1 for a balanced router
    with pytest.raises(ValueError, match="mixture of experts"):
        apply_lora(eqx_tx.load(moe_path, progress=False), rank=2, alpha=4.0, key=jax.random.key(0))


@pytest.mark.parametrize("dp,ep,tp", [(1, 2, 1), (2, 2, 2), (1, 2, 4)])
def test_expert_parallel_equals_single_device(moe_path, dp, ep, tp):
    model = eqx_tx.load(moe_path, progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, [11, 5, 9, 11], seed=4)
    ref = np.asarray(eqx_tx.logits(model, ids, mask))
    mesh = eqx_tx.make_mesh(dp=dp, ep=ep, tp=tp, devices=jax.devices()[: dp * ep * tp])
    sharded = eqx_tx.load(moe_path, mesh=mesh, progress=False)
    w = sharded.model.layers.mlp.experts.gate_proj.weight
    assert w.sharding.spec[1] == "ep"  # [layers, experts, mlp, embed]: experts over ep
    with jax.set_mesh(mesh):
        ours = np.asarray(eqx_tx.logits(sharded, jax.device_put(jnp.asarray(ids), NamedSharding(mesh, P(("dp", "ep")))), mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-5)


def test_no_dense_tokens_by_experts_by_hidden_buffer():
    config = eqx_tx.models.Qwen3MoeConfig(
        vocab_size=64, hidden_size=40, intermediate_size=8, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=20, num_experts=16, num_experts_per_tok=2,
    )
    model = eqx_tx.io.loading.abstract_model(config, jnp.float32)
    B, T = 3, 8  # 24 tokens
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    from eqx_tx.train.forward import logits_jit

    hlo = jax.jit(logits_jit, static_argnames="compute").lower(
        model, ids, jax.ShapeDtypeStruct((B,), jnp.int32), compute=eqx_tx.ComputeConfig()
    ).compile().as_text()
    shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([0-9,]+)\]", hlo)]
    # Nothing with an experts axis next to the hidden axis beyond the expert weights
    # themselves ([16, 12, 40] and [16, 40, 12]): no [tokens or rows, experts, hidden].
    weights = {(2, 16, 12, 40), (2, 16, 40, 12), (16, 12, 40), (16, 40, 12)}
    dense = [s for s in shapes if 16 in s and (40 in s or 12 in s) and s not in weights and max(s) > 0
             and any(d >= 24 for d in s if d not in (40,))]
    assert not dense, dense
