"""Packed sequences: documents sharing a row with segment ids score exactly as they do alone."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqx_tx
from eqx_tx.train.forward import segment_positions
from eqx_tx.train.training import Batch, TrainConfig, loss_and_grads
from tests.hf_utils import TP_CONFIG, make_hf_checkpoint

T = 27
# Rows of documents (token counts of (input, target) pairs); row 2 and 3 end in padding.
ROWS = [[9, 5, 13], [13, 14], [20], [4, 4, 1, 4]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("pack") / "ckpt", **TP_CONFIG)


def _docs(seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for row in ROWS:
        for n in row:
            tokens = rng.integers(1, TP_CONFIG["vocab_size"], n + 1)
            weights = rng.uniform(0.5, 1.5, n).astype(np.float32)  # real-valued weights as well
            docs.append((tokens[:-1], tokens[1:], weights))
    return docs


def packed_batch(docs) -> Batch:
    ids, tgt, w, seg = (np.zeros((len(ROWS), T), dt) for dt in (np.int32, np.int32, np.float32, np.int32))
    it = iter(docs)
    for r, row in enumerate(ROWS):
        at = 0
        for s, n in enumerate(row, 1):
            i, t, wt = next(it)
            ids[r, at:at + n], tgt[r, at:at + n], w[r, at:at + n], seg[r, at:at + n] = i, t, wt, s
            at += n
    lengths = (seg != 0).sum(1).astype(np.int32)
    return Batch(jnp.asarray(ids), jnp.asarray(tgt), jnp.asarray(w), jnp.asarray(lengths), jnp.asarray(seg))


def alone_batch(docs) -> Batch:
    """One document per row, right-padded: each runs alone."""
    L = max(len(d[0]) for d in docs)
    ids, tgt, w = (np.zeros((len(docs), L), dt) for dt in (np.int32, np.int32, np.float32))
    for r, (i, t, wt) in enumerate(docs):
        ids[r, :len(i)], tgt[r, :len(t)], w[r, :len(wt)] = i, t, wt
    lengths = np.asarray([len(d[0]) for d in docs], np.int32)
    return Batch(jnp.asarray(ids), jnp.asarray(tgt), jnp.asarray(w), jnp.asarray(lengths))


def _loss_grads(model, batch, compute, mesh=None):
    config = TrainConfig(loss_chunk_size=16, compute=compute)
    params, frozen = eqx.partition(model, eqx.is_array)
    count = jnp.float32(np.sum(np.asarray(batch.loss_weights) != 0))
    coefficients = jnp.asarray(batch.loss_weights, jnp.float32) / count  # the step's token weights
    step = jax.jit(loss_and_grads, static_argnums=4)
    if mesh is None:
        metrics, grads = step(params, frozen, batch, coefficients, config, count)
    else:
        with jax.set_mesh(mesh):
            b, c = jax.device_put((batch, coefficients), NamedSharding(mesh, P("dp")))
            metrics, grads = step(params, frozen, b, c, config, count)
    return float(metrics["loss"]), jax.tree.leaves(grads)


@pytest.fixture(scope="module")
def reference(path):
    model = eqx_tx.load(path, progress=False)
    return _loss_grads(model, alone_batch(_docs()), eqx_tx.ComputeConfig(attention="xla"))


def _assert_close(ours, ref):
    loss, grads = ours
    ref_loss, ref_grads = ref
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * float(np.abs(r).max()), rtol=0)


def test_segment_positions_restart_in_each_document():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(segment_positions(seg)),
                                  [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_packed_loss_and_grads_equal_documents_alone(path, reference, attention):
    model = eqx_tx.load(path, progress=False)
    compute = eqx_tx.ComputeConfig(attention=attention, block_q=4, block_kv=4)
    _assert_close(_loss_grads(model, packed_batch(_docs()), compute), reference)


def test_packed_on_dp_sp_tp_mesh_equals_documents_alone(path, reference):
    mesh = eqx_tx.make_mesh(dp=2, sp=2, tp=2)
    model = eqx_tx.load(path, mesh=mesh, progress=False)
    compute = eqx_tx.ComputeConfig(attention="blockwise", block_q=4, block_kv=4)
    _assert_close(_loss_grads(model, packed_batch(_docs()), compute, mesh), reference)


def test_packed_sequence_parallel_over_tp_equals_documents_alone(path, reference):
    mesh = eqx_tx.make_mesh(dp=2, sp=1, tp=4)
    model = eqx_tx.load(path, mesh=mesh, progress=False)
    compute = eqx_tx.ComputeConfig(attention="blockwise", block_q=8, block_kv=8, sequence_parallel=True)
    _assert_close(_loss_grads(model, packed_batch(_docs()), compute, mesh), reference)


def test_token_logprobs_and_logits_take_segment_ids(path):
    model = eqx_tx.load(path, progress=False)
    docs = _docs(1)
    packed, alone = packed_batch(docs), alone_batch(docs)
    ours = np.asarray(eqx_tx.token_logprobs(model, packed.input_ids, packed.target_ids, segment_ids=packed.segment_ids))
    ref = np.asarray(eqx_tx.token_logprobs(model, alone.input_ids, alone.target_ids,
                                           attention_mask=np.arange(alone.input_ids.shape[1]) < alone.lengths[:, None]))
    logits = np.asarray(eqx_tx.logits(model, packed.input_ids, segment_ids=packed.segment_ids))
    ref_logits = np.asarray(eqx_tx.logits(model, alone.input_ids, np.arange(alone.input_ids.shape[1]) < alone.lengths[:, None]))
    d = 0
    for r, row in enumerate(ROWS):
        at = 0
        for n in row:
            np.testing.assert_allclose(ours[r, at:at + n], ref[d, :n], atol=1e-5)
            np.testing.assert_allclose(logits[r, at:at + n], ref_logits[d, :n], atol=1e-4)
            at, d = at + n, d + 1


@pytest.mark.parametrize("segments,message", [
    ([[1, 1, 2, 1]], "non-decreasing"),
    ([[1, 0, 2, 2]], ">= 1 on the tokens"),
])
def test_bad_segment_ids_are_refused(path, segments, message):
    model = eqx_tx.load(path, progress=False)
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=message):
        eqx_tx.token_logprobs(model, ids, ids, attention_mask=np.ones((1, 4)), segment_ids=np.asarray(segments))
