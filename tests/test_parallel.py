"""Sequence parallelism (over tp) and context parallelism (ring attention over sp)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqx_tx
from eqx_tx.kernels.ring import load_balanced_order, padded_length, ring_attention
from eqx_tx.kernels.sdpa import xla_attention
from eqx_tx.train.loss import token_logprobs
from eqx_tx.train.training import Batch, TrainConfig, loss_and_grads
from tests.hf_utils import TP_CONFIG, make_hf_checkpoint, ragged_batch

T = 27  # not a multiple of the ring: padded to 2*sp


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("par") / "ckpt", **TP_CONFIG)


@pytest.fixture(scope="module")
def batch():
    ids, mask = ragged_batch(TP_CONFIG["vocab_size"], [T + 1, 19, T + 1, 11], seed=7)
    lengths = mask.sum(-1) - 1
    valid = np.arange(T)[None] < lengths[:, None]
    return Batch(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.asarray(valid, jnp.float32), jnp.asarray(lengths))


def _loss_grads(model, batch, compute, mesh=None):
    config = TrainConfig(loss_chunk_size=13, compute=compute)
    params, frozen = eqx.partition(model, eqx.is_array)
    count = jnp.float32(np.sum(np.asarray(batch.loss_weights) != 0))
    coefficients = jnp.asarray(batch.loss_weights, jnp.float32) / count  # the step's token weights
    if mesh is None:
        metrics, grads = jax.jit(loss_and_grads, static_argnums=4)(params, frozen, batch, coefficients, config, count)
    else:
        with jax.set_mesh(mesh):
            b, c = jax.device_put((batch, coefficients), NamedSharding(mesh, P("dp")))
            metrics, grads = jax.jit(loss_and_grads, static_argnums=4)(params, frozen, b, c, config, count)
    return float(metrics["loss"]), jax.tree.leaves(grads)


@pytest.fixture(scope="module")
def reference(path, batch):
    return _loss_grads(eqx_tx.load(path, progress=False), batch, eqx_tx.ComputeConfig(attention="blockwise", block_q=8, block_kv=8))


@pytest.mark.parametrize(
    "dp,sp,tp,sequence_parallel",
    [(4, 1, 2, True), (2, 1, 4, True), (1, 1, 8, True), (4, 2, 1, False), (2, 4, 1, False), (1, 2, 4, False),
     (1, 2, 4, True)],
)
def test_parallel_loss_and_grads_equal_single_device(path, batch, reference, dp, sp, tp, sequence_parallel):
    mesh = eqx_tx.make_mesh(dp=dp, sp=sp, tp=tp)
    model = eqx_tx.load(path, mesh=mesh, progress=False)
    compute = eqx_tx.ComputeConfig(attention="blockwise", block_q=8, block_kv=8, sequence_parallel=sequence_parallel)
    loss, grads = _loss_grads(model, batch, compute, mesh)
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * max(1.0, float(np.abs(r).max())))


def test_token_logprobs_keep_the_original_order_under_context_parallelism(path):
    model = eqx_tx.load(path, progress=False)
    ids, mask = ragged_batch(TP_CONFIG["vocab_size"], [T, 14], seed=3)
    tgt = np.roll(ids, -1, 1)
    ref = np.asarray(token_logprobs(model, jnp.asarray(ids), jnp.asarray(tgt), attention_mask=mask))
    mesh = eqx_tx.make_mesh(dp=2, sp=4, tp=1)
    with jax.set_mesh(mesh):
        sharded = eqx_tx.shard(model, mesh)
        ours = np.asarray(jax.jit(lambda m, i, t: token_logprobs(m, i, t, attention_mask=mask))(sharded, jnp.asarray(ids), jnp.asarray(tgt)))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-5)


def test_load_balanced_order():
    order = load_balanced_order(16, 2)  # chunks of 4: device 0 holds 0 and 3, device 1 holds 1 and 2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    assert padded_length(27, 4) == 32
    with pytest.raises(ValueError, match="not a multiple of 2 \\* sp"):
        load_balanced_order(10, 4)


def test_ring_attention_equals_reference_with_padding():
    B, L, H, G, K = 2, 32, 2, 2, 8
    kq, kk, kv, ko = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, L, H * G, K))
    k = jax.random.normal(kk, (B, L, H, K))
    v = jax.random.normal(kv, (B, L, H, K))
    cot = jax.random.normal(ko, (B, L, H * G, K))
    lengths = jnp.asarray([32, 21])
    ref = lambda q, k, v: xla_attention(q, k, v, kv_lengths=lengths)[0]  # noqa: E731
    mesh = eqx_tx.make_mesh(dp=2, sp=4, tp=1)
    order = load_balanced_order(L, 4)
    pos = jnp.broadcast_to(jnp.asarray(order), (B, L))

    def ours(q, k, v):
        o = ring_attention(q[:, order], k[:, order], v[:, order], positions=pos, kv_lengths=lengths,
                           mesh=jax.sharding.get_abstract_mesh(), block_q=4, block_kv=4)
        return jnp.zeros_like(o).at[:, order].set(o)

    with jax.set_mesh(mesh):
        o, g = jax.jit(lambda q, k, v: (ours(q, k, v), jax.grad(lambda *a: jnp.sum(ours(*a) * cot), (0, 1, 2))(q, k, v)))(q, k, v)
    np.testing.assert_allclose(o, ref(q, k, v), atol=1e-5)
    g_ref = jax.grad(lambda *args: jnp.sum(ref(*args) * cot), (0, 1, 2))(q, k, v)
    for ours_g, ref_g in zip(g, g_ref):
        np.testing.assert_allclose(ours_g, ref_g, atol=1e-5)


def _saved_bytes_per_layer(dp, sp, tp, sequence_parallel):
    """Slope of compiled temp memory in the number of layers (LoRA: gradients stay tiny)."""
    from eqx_tx.analysis.memory import MemoryFigures, abstract_sharded_model, compile_train_step, target_mesh

    temps = []
    for layers in (2, 4):
        config = dataclasses.replace(_memory_config(), num_hidden_layers=layers)
        mesh = target_mesh("cpu", dp=dp, sp=sp, tp=tp)
        model = abstract_sharded_model(config, mesh, jnp.float32, lora_rank=2)
        train = TrainConfig(loss_chunk_size=512, compute=eqx_tx.ComputeConfig(
            attention="blockwise", sequence_parallel=sequence_parallel))
        temps.append(MemoryFigures.of(compile_train_step(model, mesh, 2, 2048, train)).temp)
    return (temps[1] - temps[0]) / 2


def _memory_config():
    return eqx_tx.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=32)


def test_saved_activations_shrink_by_tp_and_sp():
    carry = 2 * 2048 * 256 * 4  # one layer-boundary activation [B, T, D], float32
    plain = _saved_bytes_per_layer(1, 1, 4, False)
    seq_par = _saved_bytes_per_layer(1, 1, 4, True)
    ctx_par = _saved_bytes_per_layer(1, 4, 1, False)
    assert plain == pytest.approx(carry, rel=0.1)  # replicated over tp without SP
    assert seq_par == pytest.approx(carry / 4, rel=0.1)
    assert ctx_par == pytest.approx(carry / 4, rel=0.1)


def test_policy_loss_with_entropy_equals_single_device_under_context_parallelism(path):
    """GSPO with KL and the entropy bonus (the entropy goes back to token order like the log-probs)."""
    model = eqx_tx.load(path, progress=False)
    ids, mask = ragged_batch(TP_CONFIG["vocab_size"], [T, 14, 21, T], seed=5)
    rng = np.random.default_rng(0)
    shape = ids.shape
    batch = Batch(ids, np.roll(ids, -1, 1), mask.astype(np.float32), mask.sum(1).astype(np.int32),
                  sampler_logprobs=rng.normal(-5.5, 0.3, shape).astype(np.float32),
                  advantages=np.repeat(rng.normal(size=(shape[0], 1)), shape[1], 1).astype(np.float32),
                  reference_logprobs=rng.normal(-5.5, 0.3, shape).astype(np.float32))
    compute = eqx_tx.ComputeConfig(attention="blockwise", block_q=8, block_kv=8)

    def loss(m, b):
        return eqx_tx.policy_loss(m, b, eqx_tx.PolicyLoss("gspo", normalise="sequence", kl_coef=0.1, entropy_coef=0.05),
                                  compute=compute, chunk_size=13)

    (ref, ref_metrics), ref_grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, batch)
    mesh = eqx_tx.make_mesh(dp=2, sp=2, tp=2)
    with jax.set_mesh(mesh):
        sharded = eqx_tx.shard(model, mesh)
        b = jax.device_put(batch, NamedSharding(mesh, P("dp")))
        (ours, metrics), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(sharded, b)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"], ref_metrics["entropy"], rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * max(1.0, float(np.abs(r).max())))
