"""The splash (Pallas TPU) path, run in Pallas's interpreter on CPU, against the
materialised-scores reference: the kernel alone, and a whole training step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqx_tx
from eqx_tx.kernels import dispatch
from eqx_tx.kernels.sdpa import xla_attention
from eqx_tx.kernels.splash import splash_attention, splash_tile
from eqx_tx.train.training import Batch, TrainConfig, loss_and_grads
from tests.hf_utils import make_hf_checkpoint

B, T, H, HKV, K = 3, 256, 4, 2, 64


def _qkv(seed, T=T):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, H, K)), 2 * jax.random.normal(kk, (B, T, HKV, K)),
            jax.random.normal(kv, (B, T, HKV, K)))


def _packed_segments(T):
    """Row 0: one document; row 1: three, then padding (if T > 200); row 2: two, the first a single token."""
    seg = np.zeros((B, T), np.int32)
    seg[0] = 1
    seg[1, :100], seg[1, 100:101], seg[1, 101:200] = 1, 2, 3
    seg[2, :1], seg[2, 1:] = 1, 2
    return jnp.asarray(seg)


@pytest.mark.parametrize("T", [256, 200])  # 200: padded to 256 inside
@pytest.mark.parametrize("masking", ["causal", "lengths", "segments"])
def test_splash_forward_and_gradients_equal_the_reference(masking, T):
    """Outputs and dq, dk, dv of every real query row; padding rows get no cotangent."""
    q, k, v = _qkv(1, T)
    kw: dict = {}
    real = np.ones((B, T), bool)
    if masking == "lengths":
        kw["kv_lengths"] = jnp.asarray([T, 130, 1])
        real = np.arange(T) < np.asarray(kw["kv_lengths"])[:, None]
    if masking == "segments":
        kw["segment_ids"] = _packed_segments(T)
        real = np.asarray(kw["segment_ids"]) != 0
    lengths, segments = kw.get("kv_lengths"), kw.get("segment_ids")
    cotangent = jax.random.normal(jax.random.key(2), (B, T, H, K)) * real[:, :, None, None]

    def ours(q, k, v):
        return splash_attention(q, k, v, block_q=128, block_kv=128, scale=0.2, interpret=True, **kw)

    def reference(q, k, v):
        return xla_attention(q, k, v, kv_lengths=lengths, q_segment_ids=segments, kv_segment_ids=segments,
                             scale=0.2)[0]

    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    ref_out, ref_vjp = jax.vjp(reference, q, k, v)
    assert np.all(np.isfinite(np.asarray(out)))  # padding rows too
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref_out)[real], atol=2e-5)
    for g, r in zip(vjp(cotangent), ref_vjp(cotangent)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4 * float(np.abs(r).max()))


def test_splash_refuses_what_it_cannot_run():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match="self-attention: 256 queries but 128 keys"):
        splash_attention(q, k[:, :128], v[:, :128], interpret=True)
    with pytest.raises(ValueError, match=r"block_q=192 must be a multiple of 128 dividing the sequence \(256"):
        splash_attention(q, k, v, block_q=192, interpret=True)


def test_splash_tiles_divide_the_sequence():
    assert splash_tile(2048, 512) == 512
    assert splash_tile(384, 512) == 384
    assert splash_tile(640, 512) == 128  # 640 = 5 x 128
    assert splash_tile(1536, 1024) == 768
    assert splash_tile(200, 512) is None
    assert splash_tile(256, 100) is None


TP2 = eqx_tx.make_mesh(dp=1, tp=2, devices=jax.devices()[:2])


def _choose(q=(2, 1024, 16, 128), k=(2, 1024, 8, 128), cache: dispatch.CacheKind = "none", q_offset=0, mesh=None, **compute):
    return dispatch.select_attention(q, k, jnp.bfloat16, cache=cache, q_offset=q_offset, mesh=mesh,
                                     compute=eqx_tx.ComputeConfig(**compute))


def test_auto_takes_splash_on_a_tpu_where_it_can_run(monkeypatch):
    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "tpu")  # as compiling for a TPU
    choice = _choose()
    assert choice.backend == "splash" and (choice.block_q, choice.block_kv) == dispatch.SPLASH_BLOCKS
    assert _choose(attention="blockwise").block_q == dispatch.DEFAULT_BLOCKS["tpu"][0]
    assert _choose(q=(2, 1280, 16, 128), k=(2, 1280, 8, 128)).block_q == 640  # 1024 does not divide 1280
    tiles = _choose(block_q=1024, block_kv=256)
    assert (tiles.block_q, tiles.block_kv) == (1024, 256)
    padded = _choose(q=(2, 1000, 16, 128), k=(2, 1000, 8, 128))  # run at 1024
    assert padded.backend == "splash" and (padded.block_q, padded.block_kv) == (1024, 1024)
    for why, kw in [("head_dim 64", dict(q=(2, 1024, 16, 64), k=(2, 1024, 8, 64))),
                    ("reads a KV cache", dict(cache="dense", k=(2, 4096, 8, 128))),
                    ("shard differently", dict(k=(2, 1024, 1, 128), mesh=TP2))]:
        fallback = _choose(**kw)
        assert fallback.backend == "blockwise" and "not splash because" in fallback.reason, kw
        assert why in fallback.reason
        with pytest.raises(ValueError, match="'splash' cannot run"):
            _choose(attention="splash", **kw)
    assert _choose(q=(2, 128, 16, 128), k=(2, 128, 8, 128)).backend == "xla"  # small scores
    assert _choose(mesh=TP2).backend == "splash"  # heads shard alike: shard by shard


def test_splash_is_refused_off_a_tpu():
    with pytest.raises(ValueError, match="'splash' cannot run: backend is cpu, not tpu"):
        _choose(attention="splash")


@pytest.mark.parametrize("remat,mesh_shape,S", [("full", None, 128), ("names", None, 128), ("full", (2, 2), 128),
                                                ("full", None, 100)])
def test_train_step_with_splash_equals_xla(monkeypatch, tmp_path, remat, mesh_shape, S):
    """Loss and every gradient of a padded batch through the whole model (interpreted),
    recomputing each layer, or keeping the attention output and the kernel's residuals;
    on one device, shard by shard on a dp x tp mesh, and at a length the kernel pads;
    against the single-device xla reference."""
    path = make_hf_checkpoint(tmp_path / "ckpt", vocab_size=100, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = eqx_tx.load(path, progress=False)
    rng = np.random.default_rng(0)
    lengths = np.asarray([S, 77], np.int32)
    real = np.arange(S) < lengths[:, None]
    ids = jnp.asarray(rng.integers(1, 100, (2, S)) * real, jnp.int32)
    batch = Batch(ids, jnp.roll(ids, -1, axis=1), jnp.asarray(real, jnp.float32), jnp.asarray(lengths))
    params, frozen = eqx.partition(model, eqx.is_array)
    coefficients = batch.loss_weights / batch.loss_weights.sum()

    def run(attention):
        compute = eqx_tx.ComputeConfig(attention=attention, remat=remat, remat_names=("attention",))
        config = TrainConfig(loss_chunk_size=64, compute=compute)
        metrics, grads = jax.jit(loss_and_grads, static_argnums=4)(params, frozen, batch, coefficients, config,
                                                                       batch.loss_weights.sum())
        return float(metrics["loss"]), jax.tree.leaves(grads)

    ref_loss, ref_grads = run("xla")
    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "tpu")
    if mesh_shape is None:
        loss, grads = run("splash")  # (auto takes xla for scores this small)
    else:
        mesh = eqx_tx.make_mesh(dp=mesh_shape[0], tp=mesh_shape[1], devices=jax.devices()[:4])
        params, frozen = eqx.partition(eqx_tx.load(path, mesh=mesh, progress=False), eqx.is_array)
        with jax.set_mesh(mesh):
            batch, coefficients = jax.device_put((batch, coefficients), NamedSharding(mesh, P("dp")))
            loss, grads = run("splash")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4 * float(np.abs(r).max()))


def test_prefill_from_position_0_runs_splash_over_its_own_keys(monkeypatch, tmp_path):
    """A prefill's first chunk attends over its own keys (causality hides the rest of a
    longer cache), so on a TPU it runs splash. Its logits and cache equal a prefill in
    two xla chunks, whose second chunk reads the first's keys from the cache (at every
    prompt slot; splash lets padding queries see padding keys, and decode overwrites
    those slots before it reads them)."""
    from eqx_tx.cache.allocate import new_cache
    from eqx_tx.infer.generation import prefill
    from eqx_tx.kernels import sdpa

    path = make_hf_checkpoint(tmp_path / "ckpt", vocab_size=100, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = eqx_tx.load(path, progress=False)
    S, max_len = 128, 192
    lengths = jnp.asarray([S, 77], jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 100, (2, S)) * (np.arange(S) < lengths[:, None]),
                         jnp.int32)

    def run(attention, chunk):
        cache = new_cache(model.config, 2, max_len, model.dtype)
        return prefill(model, cache, tokens, lengths, chunk=chunk, compute=eqx_tx.ComputeConfig(attention=attention))

    ref_cache, ref_logits = run("xla", S // 2)
    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "tpu")
    calls = []
    monkeypatch.setattr(sdpa, "splash_attention", lambda *a, **kw: calls.append(a[1].shape) or splash_attention(*a, **kw))
    cache, logits = run("splash", S)  # raised before: "it reads a KV cache"
    assert calls == [(2, S, 2, 128)] * 1  # traced once (the scanned layer), over the chunk's own keys
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-4 * float(np.abs(ref_logits).max()))
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):  # [layers, batch, max_len, ...]
        for row, length in enumerate(lengths.tolist()):  # slots past a prompt are overwritten before they are read
            np.testing.assert_allclose(np.asarray(got[:, row, :length]), np.asarray(want[:, row, :length]), atol=1e-5)
