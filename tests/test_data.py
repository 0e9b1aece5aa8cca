"""The data path: packing modes, segment ids, resumable batches."""

import numpy as np
import pytest

from eqx_tx.train.data import Examples
from eqx_tx.train.forward import check_segment_ids

SEQ = 16


def _docs(seed=0, n=40):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 14, n).tolist() + [40, 18, 17]  # two longer than a row (split), one a full row
    return [rng.integers(1, 1000, L).tolist() for L in lengths]


def _pairs(inputs, targets):
    return list(zip(inputs.tolist(), targets.tolist()))


def test_segments_hold_every_document_once_and_alone():
    docs = _docs()
    ex = Examples(docs, SEQ, packing="segments")
    assert ex.segment_ids is not None and ex.split == 2
    check_segment_ids(ex.segment_ids, ex.lengths)
    found = []
    for r in range(len(ex)):
        seg = ex.segment_ids[r]
        assert ex.lengths[r] == np.sum(seg != 0) <= SEQ
        np.testing.assert_array_equal(ex.weights[r], (seg != 0).astype(np.float32))
        for s in range(1, seg.max() + 1):
            at = seg == s
            found.append(_pairs(ex.inputs[r, at], ex.targets[r, at]))
    # Each document's pairs, whole or as consecutive row-sized pieces.
    expected = []
    for d in docs:
        pairs = list(zip(d[:-1], d[1:]))
        expected += [pairs[i: i + SEQ] for i in range(0, len(pairs), SEQ)]
    assert sorted(found) == sorted(expected)


def test_segments_waste_less_than_padding_and_pack_keeps_windows():
    docs = _docs(1, 200)
    segments = Examples(docs, SEQ, packing="segments")
    padded = Examples(docs, SEQ, packing="pad")
    total_pairs = sum(len(d) - 1 for d in docs)
    assert segments.lengths.sum() == total_pairs
    assert segments.padding_fraction < 0.05 < padded.padding_fraction
    assert len(segments) < len(padded)
    pack = Examples(docs, SEQ, packing="pack")
    stream = np.concatenate(docs)
    np.testing.assert_array_equal(pack.inputs[1], stream[SEQ + 1: 2 * SEQ + 1])
    assert pack.segment_ids is None and pack.padding_fraction == 0


def test_batches_are_a_function_of_seed_and_step():
    ex = Examples(_docs(), SEQ, packing="segments")
    a, b = ex.batch(5, 4, seed=3), ex.batch(5, 4, seed=3)
    for x, y in zip((a.input_ids, a.segment_ids), (b.input_ids, b.segment_ids)):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(ex.batch(5, 4, seed=4).input_ids, a.input_ids)
    # A process's share is the same rows the whole batch has there.
    np.testing.assert_array_equal(ex.batch(5, 4, seed=3, rows=slice(2, 4)).segment_ids, a.segment_ids[2:4])


def test_bad_packing_is_refused():
    with pytest.raises(ValueError, match="packing must be one of segments, pack, pad"):
        Examples(_docs(), SEQ, packing="concat")  # type: ignore[arg-type]
