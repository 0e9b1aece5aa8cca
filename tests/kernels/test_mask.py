"""The one masking rule, in both layouts, against the rule written out element by element."""

import numpy as np

from eqx_tx.kernels.mask import AttentionMask, visible


def _by_hand(q_pos, k_pos, lengths, q_seg, k_seg, causal):
    B, T, S = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = np.zeros((B, T, S), bool)
    for b in range(B):
        for i in range(T):
            for j in range(S):
                ok = k_pos[b, j] < lengths[b] and (not causal or k_pos[b, j] <= q_pos[b, i])
                if q_seg is not None:
                    ok = ok and q_seg[b, i] == k_seg[b, j] and k_seg[b, j] != 0
                out[b, i, j] = ok
    return out


def test_both_layouts_follow_the_rule():
    rng = np.random.default_rng(0)
    B, T, S = 3, 5, 9
    q_pos = np.sort(rng.integers(0, 12, (B, T)), axis=1)
    k_pos = np.broadcast_to(np.arange(S), (B, S)) + rng.integers(0, 3, (B, 1))
    lengths = rng.integers(0, 12, (B,))
    q_seg, k_seg = rng.integers(0, 3, (B, T)), rng.integers(0, 3, (B, S))
    for causal in (True, False):
        for segments in ((None, None), (q_seg, k_seg)):
            want = _by_hand(q_pos, k_pos, lengths, *segments, causal)
            rows = visible(q_pos, k_pos, lengths, causal=causal, q_segments=segments[0], k_segments=segments[1],
                           layout="rows")
            spread = visible(q_pos[:, :, None], k_pos[:, None, :], lengths[:, None, None], causal=causal,
                             q_segments=None if segments[0] is None else segments[0][:, :, None],
                             k_segments=None if segments[1] is None else segments[1][:, None, :])
            # (a mask with no query-dependent term may come with a query axis of 1: it broadcasts)
            np.testing.assert_array_equal(np.broadcast_to(np.asarray(rows), want.shape), want)
            np.testing.assert_array_equal(np.broadcast_to(np.asarray(spread), want.shape), want)
    assert want.any() and not want.all()  # (the draw exercises both outcomes)


def test_decode_mask_sees_its_own_position():
    mask = AttentionMask.decode(np.array([0, 4]))
    np.testing.assert_array_equal(mask.kv_lengths, [1, 5])
    assert not mask.from_start and AttentionMask(None).from_start
