"""Tensor-parallel sharding on a fake 8-device CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqx_tx
from eqx_tx.core.sharding import logical_to_spec, make_mesh
from tests.hf_utils import TP_CONFIG, make_hf_checkpoint, ragged_batch


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", **TP_CONFIG)


@pytest.fixture(scope="module")
def single_device_logits(tp_checkpoint):
    model = eqx_tx.load(tp_checkpoint, progress=False)
    ids, mask = ragged_batch(model.config.vocab_size, [13, 6])
    return ids, mask, np.asarray(eqx_tx.logits(model, ids, mask))


def _spec(x):
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_logits_equal_single_device(tp_checkpoint, single_device_logits, tp):
    mesh = make_mesh(dp=1, tp=tp, devices=jax.devices()[:tp])
    model = eqx_tx.load(tp_checkpoint, mesh=mesh, progress=False)
    ids, mask, ref = single_device_logits
    ours = np.asarray(eqx_tx.logits(model, ids, mask))
    np.testing.assert_allclose(ours, ref, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_weights_are_sharded_as_the_rules_say(tp_checkpoint, tp):
    mesh = make_mesh(dp=1, tp=tp, devices=jax.devices()[:tp])
    model = eqx_tx.load(tp_checkpoint, mesh=mesh, progress=False)
    layers = model.model.layers
    kv = "tp" if TP_CONFIG["num_key_value_heads"] % tp == 0 else None
    expected = {
        "embed": (model.model.embed_tokens.weight, ("tp", None)),
        "lm_head": (model.lm_head.weight, ("tp", None)),
        "q_proj": (layers.self_attn.q_proj.weight, (None, "tp", None, None)),
        "k_proj": (layers.self_attn.k_proj.weight, (None, kv, None, None)),
        "v_proj": (layers.self_attn.v_proj.weight, (None, kv, None, None)),
        "o_proj": (layers.self_attn.o_proj.weight, (None, None, "tp", None)),
        "gate_proj": (layers.mlp.gate_proj.weight, (None, "tp", None)),
        "up_proj": (layers.mlp.up_proj.weight, (None, "tp", None)),
        "down_proj": (layers.mlp.down_proj.weight, (None, None, "tp")),
        "q_norm": (layers.self_attn.q_norm.weight, (None, None)),
        "final_norm": (model.model.norm.weight, (None,)),
    }
    for name, (arr, spec) in expected.items():
        assert _spec(arr) == spec, name
        # Each device really holds only its slice.
        shard_shape = arr.addressable_shards[0].data.shape
        want = tuple(n // tp if s == "tp" else n for n, s in zip(arr.shape, spec))
        assert shard_shape == want, name


def test_rules_refuse_one_mesh_axis_twice():
    mesh = make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="used twice"):
        logical_to_spec(("heads", "mlp"), (4, 4), mesh)
    assert logical_to_spec(("vocab", "embed"), (8, 4), mesh) == P("tp", None)
    assert logical_to_spec(("vocab", "embed"), (7, 4), mesh) == P(None, None)  # 7 does not divide


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="not divisible.*device_count=3 before JAX starts"):
        make_mesh(tp=3)
    with pytest.raises(ValueError, match=r"!= 8 cpu device\(s\).*device_count=4 before"):
        make_mesh(dp=2, tp=2)


def test_init_model_is_created_sharded():
    mesh = make_mesh(dp=1, tp=4, devices=jax.devices()[:4])
    config = eqx_tx.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    model = eqx_tx.init_model(config, key=jax.random.key(0), dtype=jnp.bfloat16, mesh=mesh)
    w = model.model.layers.mlp.gate_proj.weight
    assert w.dtype == jnp.bfloat16
    assert w.addressable_shards[0].data.shape == (2, 32, 64)


def test_rules_refuse_unknown_logical_names():
    mesh = make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    with pytest.raises(KeyError, match=r"\['hedas'\].*no sharding rule"):
        logical_to_spec(("hedas", "embed"), (4, 4), mesh)


def test_stacked_axes_come_from_the_container_declaration():
    from eqx_tx.core.sharding import logical_axes
    from eqx_tx.io.loading import abstract_model

    config = eqx_tx.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16)
    axes = logical_axes(abstract_model(config, jnp.float32))
    layers = axes.model.layers
    assert layers.self_attn.q_proj.weight.names == ("layers", "heads", "head_dim", "embed")
    assert layers.mlp.experts.down_proj.weight.names == ("layers", "experts", "embed", "mlp")
    assert layers.mlp.gate.weight.names == ("layers", "router", "embed")
    assert axes.model.embed_tokens.weight.names == ("vocab", "embed")


def test_optimizer_state_follows_each_parameter_even_when_shapes_collide():
    """gate_proj [L, I, E] and down_proj [L, E, I] have one shape when I == E but are
    sharded on different axes; each Adam moment must take its own parameter's sharding."""
    import optax

    from eqx_tx.analysis.memory import abstract_sharded_model, abstract_train_state
    from eqx_tx.train.training import TrainConfig

    mesh = make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    config = eqx_tx.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = abstract_sharded_model(config, mesh, jnp.float32)
    params, opt_state, _ = abstract_train_state(model, mesh, TrainConfig())
    mlp = params.model.layers.mlp
    assert mlp.gate_proj.weight.shape == mlp.down_proj.weight.shape
    assert mlp.gate_proj.weight.sharding.spec != mlp.down_proj.weight.sharding.spec
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1
    for moments in (adam[0].mu, adam[0].nu):
        for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(moments), strict=True):
            assert m.shape == p.shape and m.sharding == p.sharding
    assert adam[0].count.sharding.spec == P()
