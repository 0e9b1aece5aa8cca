"""remat="offload" (saved layer inputs in host memory) and remat="auto" (the fastest
policy that fits a budget), against remat="full" and the compiled memory analysis."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqx_tx
from eqx_tx.layers.lora import apply_lora
from eqx_tx.train.remat_auto import choose_remat
from eqx_tx.train.training import (
    Batch,
    OptimizerConfig,
    TrainConfig,
    init_train_state,
    resolve_remat,
    train_step,
    train_step_jit,
)

OPT = OptimizerConfig(learning_rate=1e-2, total_steps=4, eps=1e-4)


def _batch(vocab, batch=4, seq=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    lengths = jnp.asarray(rng.integers(seq // 2, seq + 1, batch), jnp.int32)
    weights = (jnp.arange(seq)[None] < lengths[:, None]).astype(jnp.float32)
    return Batch(ids[:, :-1], ids[:, 1:], weights, lengths)


def _step(make_model, batch, compute, mesh=None):
    """One step from a fresh model (the step donates the trainable arrays)."""
    config = TrainConfig(optimizer=OPT, loss_chunk_size=16, compute=compute)
    if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, P("dp")))
    state, metrics = train_step(init_train_state(make_model(), config), batch, config)
    return jax.tree.leaves(state.params), metrics


def test_offload_keeps_the_layer_inputs_in_host_memory(checkpoints):
    """The traced step holds a stacked [layers, ...] residual in host memory under
    offload and none under full (XLA:CPU then compiles the transfers away: the
    device-memory saving shows on GPU targets, benchmarks/benchmark_memory.py stage 9)."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    batch = _batch(model.config.vocab_size)
    L = model.config.num_hidden_layers
    texts = {}
    for remat in ("full", "offload"):
        config = TrainConfig(optimizer=OPT, compute=eqx_tx.ComputeConfig(remat=remat))
        state = init_train_state(model, config)
        traced = train_step_jit.trace(state.params, state.opt_state, state.step, state.frozen, batch, config)
        texts[remat] = str(traced.jaxpr)
    assert f"f32<host>[{L},4,64,{model.config.hidden_size}]" in texts["offload"]
    assert "<host>" not in texts["full"]


@pytest.mark.parametrize("lora", [False, True])
def test_offload_step_equals_full(checkpoints, lora):
    """Full fine-tuning on one device; LoRA under sequence parallelism on dp2 x tp2."""
    path = checkpoints["gqa4_bias"]
    mesh = eqx_tx.make_mesh(dp=2, tp=2, devices=jax.devices()[:4]) if lora else None

    def make_model():
        model = eqx_tx.load(path, mesh=mesh, progress=False)
        if lora:
            model = eqx_tx.shard(apply_lora(model, rank=4, alpha=8.0, key=jax.random.key(0)), mesh)
        return model

    batch = _batch(128, seed=1)
    results = [_step(make_model, batch, eqx_tx.ComputeConfig(remat=r, sequence_parallel=lora), mesh)
               for r in ("full", "offload")]
    (full, m_full), (off, m_off) = results
    np.testing.assert_allclose(m_off["loss"], m_full["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_off["grad_norm"], m_full["grad_norm"], rtol=1e-6)
    for a, b in zip(off, full):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _figures(state, batch, compute):
    config = TrainConfig(optimizer=OPT, loss_chunk_size=16, compute=compute)
    args = (state.params, state.opt_state, state.step, state.frozen, batch)
    return lambda c: train_step_jit.trace(*args, dataclasses.replace(config, compute=c))


def test_auto_picks_the_fastest_policy_that_fits(checkpoints):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    batch = _batch(model.config.vocab_size, batch=8, seq=256, seed=2)
    auto = eqx_tx.ComputeConfig(attention="xla", remat="auto")
    state = init_train_state(model, TrainConfig(optimizer=OPT))
    trace = _figures(state, batch, auto)

    chosen, figures = choose_remat(trace, auto, budget_bytes=2**40)
    assert chosen.remat == "none" and figures[0].compute == chosen
    flops = {f.compute.remat: f.flops for f in figures}
    assert flops["none"] < flops["dots"] < flops["full"] == flops["offload"]  # full recomputes the forward

    # With the budget at `full`'s compiled peak, the choice is the first candidate in
    # FLOPs order that fits: every one before it was compiled and found too big.
    m = trace(dataclasses.replace(auto, remat="full")).lower().compile().memory_analysis()
    budget = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    chosen, figures = choose_remat(trace, auto, budget_bytes=budget)
    i = [f.compute for f in figures].index(chosen)
    assert [f.flops for f in figures] == sorted(f.flops for f in figures)
    assert figures[i].device_bytes is not None and figures[i].device_bytes <= budget
    assert all(f.device_bytes is not None and f.device_bytes > budget for f in figures[:i])
    assert i > 0 and figures[0].compute.remat == "none"  # keeping everything does not fit
    assert flops[chosen.remat] <= flops["full"]

    with pytest.raises(ValueError, match=r'remat="auto": no policy fits the budget of 0.00 GiB per device'):
        choose_remat(trace, auto, budget_bytes=1024)


class _Refused:
    """A traced step whose compilation fails as a TPU compiler's does for a program
    that does not fit the device."""

    def __init__(self, traced):
        self.jaxpr = traced.jaxpr

    def lower(self):
        return self

    def compile(self):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.")


def test_auto_passes_over_what_the_compiler_refuses(checkpoints):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    auto = eqx_tx.ComputeConfig(attention="xla", remat="auto")
    real = _figures(init_train_state(model, TrainConfig(optimizer=OPT)), _batch(model.config.vocab_size), auto)

    chosen, figures = choose_remat(lambda c: _Refused(real(c)) if c.remat in ("none", "dots") else real(c), auto,
                                   budget_bytes=2**40)
    assert [f.refused for f in figures[:3]] == [True, True, False]
    assert (chosen.remat, chosen.remat_names) == ("names", ("q", "k", "v", "attention", "mlp_hidden"))
    with pytest.raises(ValueError, match="the compiler refused every one as too big for the device"):
        choose_remat(lambda c: _Refused(real(c)), auto, budget_bytes=2**40)


def test_train_step_resolves_auto_and_equals_full(checkpoints):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    batch = _batch(model.config.vocab_size, seed=3)
    auto = eqx_tx.ComputeConfig(remat="auto", memory_budget_gib=1.0)
    config = TrainConfig(optimizer=OPT, loss_chunk_size=16, compute=auto)
    state = init_train_state(model, config)
    resolved = resolve_remat(state.params, state.opt_state, state.step, state.frozen, batch, config)
    assert resolved.compute.remat == "none"  # a tiny model: everything fits, nothing is recomputed
    load = lambda: eqx_tx.load(checkpoints["mha_tied"], progress=False)  # noqa: E731
    (p_auto, m_auto), (p_full, m_full) = (_step(load, batch, c) for c in (auto, eqx_tx.ComputeConfig(remat="full")))
    np.testing.assert_allclose(m_auto["loss"], m_full["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_auto["grad_norm"], m_full["grad_norm"], rtol=1e-6)
    for a, b in zip(p_auto, p_full):  # (Adam's m / sqrt(v) scales float-order noise up to ~lr * 1e-4)
        np.testing.assert_allclose(a, b, atol=2e-6)
    with pytest.raises(ValueError, match='remat="auto" is a choice to make before compiling'):
        eqx_tx.token_logprobs(model, batch.input_ids, batch.target_ids, compute=auto)


@pytest.mark.parametrize("attention", ["splash", "blockwise"])
def test_keeping_the_attention_saves_the_splash_forward(monkeypatch, tmp_path, attention):
    """`names(attention)` keeps the splash kernel's residuals, so its backward pass
    does not rerun the forward kernel: fewer FLOPs than `full` by exactly that kernel
    in every layer, and `auto` ranks it first of the two. The blockwise kernel's
    residuals are not kept: the two tie, and `full` (less memory) stays first."""
    from eqx_tx.core.flops import traced_flops
    from eqx_tx.kernels import dispatch
    from eqx_tx.train.remat_auto import remat_candidates
    from tests.hf_utils import make_hf_checkpoint

    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "tpu")  # as compiling for a TPU
    L, H, K, B, T = 2, 4, 128, 2, 128
    path = make_hf_checkpoint(tmp_path / "ckpt", vocab_size=100, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=2, head_dim=K)
    model = eqx_tx.load(path, progress=False)
    auto = eqx_tx.ComputeConfig(attention=attention, remat="auto")  # type: ignore[arg-type]
    trace = _figures(init_train_state(model, TrainConfig(optimizer=OPT)), _batch(100, batch=B, seq=T), auto)
    flops = {(c.remat, c.remat_names): traced_flops(trace(c)) for c in remat_candidates(auto)}
    full, names = flops[("full", ())], flops[("names", ("attention",))]
    if attention == "splash":
        assert full - names == L * 2 * (2 * B * H * T * T * K)  # QKᵀ and PV of every layer's forward kernel
    else:
        assert full == names
    order = [c for c in remat_candidates(auto) if (c.remat, c.remat_names) in (("full", ()), ("names", ("attention",)))]
    ranked = sorted(order, key=lambda c: flops[(c.remat, c.remat_names)])
    assert ranked[0].remat == ("names" if attention == "splash" else "full")
