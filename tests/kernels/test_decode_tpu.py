"""The decode attention kernel (Pallas TPU), run in Pallas's interpreter on CPU,
against a plain numpy reference and against `generate` on the xla path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_tx
from eqx_tx.kernels import dispatch
from eqx_tx.kernels.decode_tpu import (
    decode_attention_blocks,
    decode_attention_blocks_shared,
    decode_attention_dense,
    decode_attention_dense_with_lse,
    decode_attention_shared_with_lse,
    dense_block,
)
from eqx_tx.kernels.quantized import Quantized, scales_by_token, stored_scales
from tests.hf_utils import make_hf_checkpoint


def _reference(q, k, v, lengths):
    """Softmax attention of `q [B, N, H]` over `k, v [B, S, K, H]`'s first `lengths[b]` keys."""
    B, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for n in range(N):
            keys, values = k[b, :lengths[b], n // G].astype(np.float64), v[b, :lengths[b], n // G].astype(np.float64)
            s = keys @ q[b, n].astype(np.float64) / np.sqrt(H)
            p = np.exp(s - s.max())
            out[b, n] = p / p.sum() @ values
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block,tokens_per_step", [(64, 64), (64, 128), (256, 512)])
def test_dense_cache_read_in_place_equals_the_reference(dtype, block, tokens_per_step):
    """Layer 1 of a 3-layer stacked cache; lengths inside a block, at a block's edge,
    the whole cache and a single key; one block per grid step, and two."""
    L, B, S, K, H, N = 3, 4, 256, 8, 128, 16
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((L, B, S, K, H)), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), dtype)
    lengths = np.array([1, 100, S, block + 1])
    out = decode_attention_dense(q, k, v, jnp.asarray(1), jnp.asarray(lengths), block=block,
                                 tokens_per_step=tokens_per_step, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = _reference(np.asarray(q[:, 0], np.float32), np.asarray(k[1], np.float32), np.asarray(v[1], np.float32),
                      lengths)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out[:, 0], np.float32), want, atol=tol)


@pytest.mark.parametrize("tokens_per_step", [16, 32, 512])
def test_blocks_through_a_table_equal_the_reference(tokens_per_step):
    """A pool of shuffled pages: each sequence's keys are gathered through its table
    (entries past its length point anywhere, even outside the pool); one page per grid
    step, two (a step past a sequence's last page re-reads it, masked), and the whole
    table."""
    L, pages, page, K, H, N = 2, 12, 16, 8, 128, 16
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((L, pages, page, K, H)).astype(np.float32) for _ in range(2))
    order = rng.permutation(pages)
    table = np.array([order[:4], order[4:8], np.r_[order[8:10], pages, pages]])
    lengths = np.array([40, 33, 20])  # 3, 3 and 2 of 4 blocks: the grid covers each sequence's own steps
    q = rng.standard_normal((3, N, H)).astype(np.float32)
    out = decode_attention_blocks(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(0), jnp.asarray(table),
                                  jnp.asarray(lengths), tokens_per_step=tokens_per_step, interpret=True)
    gathered = lambda x: np.stack([x[0, row].reshape(-1, K, H) for row in np.minimum(table, pages - 1)])  # noqa: E731
    np.testing.assert_allclose(np.asarray(out), _reference(q, gathered(k), gathered(v), lengths), atol=1e-5)


def test_rows_without_a_block_in_the_pool_read_nothing_and_give_zeros():
    """An engine's padding row (its table outside the pool) has no grid step: its output
    is zeros and the other rows' are as alone; with no row holding a block, all zeros."""
    L, pages, page, K, H, N = 1, 6, 16, 2, 128, 4
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((L, pages, page, K, H)).astype(np.float32) for _ in range(2))
    table = np.array([[pages] * 3, [4, 1, 0], [pages] * 3, [2, 5, 3]])
    lengths = np.array([1, 40, 1, 17])
    q = rng.standard_normal((4, N, H)).astype(np.float32)
    run = lambda t, n: np.asarray(decode_attention_blocks(  # noqa: E731
        jnp.asarray(q[:len(t)]), jnp.asarray(k), jnp.asarray(v), jnp.asarray(0), jnp.asarray(t),
        jnp.asarray(lengths[:len(t)]), tokens_per_step=n, interpret=True))
    for tokens_per_step in (16, 32):
        out = run(table, tokens_per_step)
        np.testing.assert_array_equal(out[[0, 2]], 0.0)
        gathered = lambda x: np.stack([x[0, row].reshape(-1, K, H) for row in table[[1, 3]]])  # noqa: E731
        np.testing.assert_allclose(out[[1, 3]], _reference(q[[1, 3]], gathered(k), gathered(v), lengths[[1, 3]]),
                                   atol=1e-5)
        np.testing.assert_array_equal(run(table[[0, 2]], tokens_per_step), 0.0)


def _quantized(x):
    """int8 values and scales (as the caches store them) of `x [..., tokens, kv_heads,
    head_dim]`, and `x` as they give it back."""
    q = Quantized.quantize(jnp.asarray(x))
    return q.values, stored_scales(q.scale), np.asarray(q.dequantize(jnp.float32))


def _as(x, dtype):
    """`x` as the kernel takes it in `dtype` (float32, for the reference)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def _stored(k, v, int8: bool):
    """`k, v` as a cache stores them (int8: values), their scales (`None` unless int8),
    and the keys/values attention sees (int8: dequantized)."""
    if not int8:
        return k, v, None, k, v
    (kq, ks, kd), (vq, vs, vd) = _quantized(k), _quantized(v)
    return kq, vq, (ks, vs), kd, vd


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens_per_step", [256, 512])
@pytest.mark.parametrize("paged", [False, True])
def test_int8_cache_equals_the_reference_over_its_dequantized_values(paged, tokens_per_step, q_dtype):
    """int8 keys/values with scales per (token, kv head): the kernel equals attention
    over the dequantized cache, read in place (dense, blocks of 256: 16 rows of
    scales) and through a shuffled page table (pages of 128: 8 rows, 2 query heads per
    kv head), one or more blocks per grid step. float32 queries take float32 matmuls;
    bf16 ones bf16 matmuls; the scales are applied in float32 either way."""
    rng = np.random.default_rng(2)
    K, H, N = 8, 128, 16
    if paged:
        L, pages, page = 2, 6, 128
        k, v = (rng.standard_normal((L, pages, page, K, H)).astype(np.float32) * 3 for _ in range(2))
        (kq, ks, kd), (vq, vs, vd) = _quantized(k), _quantized(v)
        order = rng.permutation(pages)
        table = np.array([order[:3], np.r_[order[3:5], pages]])
        lengths = np.array([300, 129])
        q = rng.standard_normal((2, N, H)).astype(np.float32)
        out = decode_attention_blocks(jnp.asarray(q, q_dtype), kq, vq, jnp.asarray(1), jnp.asarray(table),
                                      jnp.asarray(lengths), scales=(ks, vs), tokens_per_step=tokens_per_step,
                                      interpret=True)
        gathered = lambda x: np.stack([x[1, row].reshape(-1, K, H) for row in np.minimum(table, pages - 1)])  # noqa: E731
        want = _reference(_as(q, q_dtype), gathered(kd), gathered(vd), lengths)
    else:
        L, B, S = 2, 3, 512
        k, v = (rng.standard_normal((L, B, S, K, H)).astype(np.float32) * 3 for _ in range(2))
        (kq, ks, kd), (vq, vs, vd) = _quantized(k), _quantized(v)
        lengths = np.array([1, 200, S])
        q = rng.standard_normal((B, 1, N, H)).astype(np.float32)
        out = decode_attention_dense(jnp.asarray(q, q_dtype), kq, vq, jnp.asarray(0), jnp.asarray(lengths),
                                     scales=(ks, vs), block=256, tokens_per_step=tokens_per_step, interpret=True)[:, 0]
        want = _reference(_as(q[:, 0], q_dtype), kd[0], vd[0], lengths)
    tol = dict(atol=1e-5) if q_dtype == jnp.float32 else dict(atol=2e-2, rtol=1e-2)  # bf16: output and p @ v rounded
    np.testing.assert_allclose(np.asarray(out, np.float32), want, **tol)


@pytest.mark.parametrize("paged", [False, True])
def test_int8_scales_in_short_rows_equal_the_reference_in_the_interpreter(paged):
    """3 kv heads (42 tokens to a row of 126 scales) read in blocks of 16 tokens, whose
    scales are no whole rows: from pages of 16 (one short row each) and from a dense
    cache of 96 (rows of 42 tokens); the interpreter reads them as rows of 48."""
    rng = np.random.default_rng(7)
    K, H, N, blocks = 3, 16, 6, 6
    if paged:
        k, v = (rng.standard_normal((1, blocks, 16, K, H)).astype(np.float32) for _ in range(2))
    else:
        k, v = (rng.standard_normal((1, 2, 48, K, H)).astype(np.float32) for _ in range(2))
    (kq, ks, kd), (vq, vs, vd) = _quantized(k), _quantized(v)
    assert ks.shape == ((1, blocks, 1, 1, 48) if paged else (1, 2, 1, 2, 126))
    q = rng.standard_normal((2, N, H)).astype(np.float32)
    lengths = np.array([45, 20])
    if paged:
        table = np.array([[4, 0, 2], [5, 1, 3]])
        out = decode_attention_blocks(jnp.asarray(q), kq, vq, jnp.asarray(0), jnp.asarray(table), jnp.asarray(lengths),
                                      scales=(ks, vs), tokens_per_step=32, interpret=True)
        kd, vd = (np.stack([x[0, row].reshape(-1, K, H) for row in table]) for x in (kd, vd))
    else:
        out = decode_attention_dense(jnp.asarray(q[:, None]), kq, vq, jnp.asarray(0), jnp.asarray(lengths),
                                     scales=(ks, vs), block=16, tokens_per_step=32, interpret=True)[:, 0]
        kd, vd = kd[0], vd[0]
    np.testing.assert_allclose(np.asarray(out), _reference(q, kd, vd, lengths), atol=1e-5)


def test_scale_columns_put_each_stored_scale_on_its_score_column():
    """A block's score column `t * kv_heads + h` is multiplied by the scale of token `t`,
    head `h`, read from the block's rows of the stored layout (4 blocks of 128 tokens);
    the layout is `scales_by_token`'s inverse."""
    from eqx_tx.kernels.decode_tpu import scale_columns

    rng = np.random.default_rng(5)
    K, block, blocks = 8, 128, 4
    scales = rng.uniform(1e-4, 3e-2, (blocks * block, K)).astype(np.float32)
    stored = stored_scales(jnp.asarray(scales))[0]  # [rows, 128]
    np.testing.assert_array_equal(np.asarray(scales_by_token(stored[None], blocks * block, K)), scales)
    x = rng.standard_normal((16, blocks * block * K)).astype(np.float32)
    tile = block * K // 128
    out = scale_columns(jnp.asarray(x), [stored[i * tile:(i + 1) * tile] for i in range(blocks)])
    np.testing.assert_array_equal(np.asarray(out), x * scales.reshape(1, -1))


def test_dense_block_divides_the_cache():
    assert dense_block(4096) == 512 and dense_block(640) == 128 and dense_block(576) == 64 and dense_block(100) == 4


def _choose(q=(64, 1, 16, 128), k=(64, 1024, 8, 128), cache="dense", dtype=jnp.bfloat16, page_size=None,
            **compute):
    return dispatch.select_attention(q, k, dtype, cache=cache, q_offset=jnp.zeros(q[0], jnp.int32), mesh=None,
                                     compute=eqx_tx.ComputeConfig(**compute), page_size=page_size)


def test_auto_takes_the_decode_kernel_on_a_tpu_where_it_can_run(monkeypatch):
    assert _choose().backend == "xla"  # on CPU
    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "tpu")  # as compiling for a TPU
    assert _choose().backend == "decode_tpu"
    assert _choose(attention="xla").backend == "xla"
    for kw, why in [(dict(q=(64, 4, 16, 128)), "4 queries per sequence"), (dict(k=(64, 1024, 2, 128)), "2 kv heads"),
                    (dict(q=(64, 1, 16, 64), k=(64, 1024, 8, 64)), "head_dim 64")]:
        choice = _choose(**kw)
        assert choice.backend != "decode_tpu" and (why in choice.reason or kw.get("q", (0, 1))[1] != 1), choice
    assert _choose(cache="int8").backend == "decode_tpu"  # 1024 slots: blocks of 512
    # int8 scales are read in tiles of [8, 128]: a block of 64 tokens of 8 kv heads is half a tile.
    choice = _choose(cache="int8", k=(64, 1088, 8, 128))
    assert choice.backend == "blockwise" and "blocks of 64 tokens" in choice.reason, choice
    assert _choose(q=(64, 4, 16, 128), attention="decode_tpu").backend == "xla"  # not decoding: as under auto
    with pytest.raises(ValueError, match="'decode_tpu' cannot run: head_dim 64"):
        _choose(q=(64, 1, 16, 64), k=(64, 1024, 8, 64), attention="decode_tpu")
    assert _choose(cache="paged", page_size=16).backend == "decode_tpu"
    assert _choose(cache="paged_int8", page_size=128).backend == "decode_tpu"
    choice = _choose(cache="paged_int8", page_size=16)
    assert choice.backend == "paged" and "blocks of 16 tokens" in choice.reason, choice
    with pytest.raises(ValueError, match="'decode_tpu' cannot run: int8 scales of 8 kv heads read in blocks of 16"):
        _choose(cache="paged_int8", page_size=16, attention="decode_tpu")
    # A shared prompt's samples: both parts in place under auto, where the int8 blocks of both parts are whole.
    assert _choose(cache="shared_prefix").backend == "decode_tpu"
    assert _choose(cache="shared_prefix_int8", page_size=128).backend == "decode_tpu"
    choice = _choose(cache="shared_prefix_int8", page_size=64)
    assert choice.backend == "shared_prefix" and "blocks of 64 tokens" in choice.reason, choice
    assert _choose(cache="shared_prefix", attention="xla").backend == "shared_prefix"
    assert _choose(q=(64, 4, 16, 128), cache="shared_prefix").backend == "shared_prefix"  # not decoding
    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "cpu")
    assert _choose(cache="shared_prefix").backend == "shared_prefix"
    assert "Pallas interpreter" in _choose(q=(4, 1, 4, 16), k=(4, 64, 2, 16), attention="decode_tpu").reason
    for cache in ("int8", "paged_int8"):  # the interpreter takes any block
        assert _choose(cache=cache, page_size=16, attention="decode_tpu").backend == "decode_tpu"


def _small_model_and_requests(tmp_path):
    """A 2-layer GQA checkpoint, and a greedy and a sampled request of different lengths."""
    path = make_hf_checkpoint(tmp_path / "ckpt", vocab_size=100, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    prompts = [[5, 6, 7], list(range(10, 30))]
    params = [eqx_tx.SamplingParams(max_new_tokens=12, temperature=0.0),
              eqx_tx.SamplingParams(max_new_tokens=9, temperature=1.0, seed=3)]
    return eqx_tx.load(path, progress=False), prompts, params


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_generate_on_the_kernel_equals_xla(tmp_path, monkeypatch, cache_dtype):
    """Greedy and sampled tokens and their log-probs from `generate` with every decode
    step's attention on the kernel (interpreted) equal those of the xla path (which
    dequantizes an int8 cache whole); prompts of different lengths, `n=2` samples
    each."""
    from eqx_tx.cache import dense

    calls = []
    monkeypatch.setattr(dense, "decode_attention_dense",
                        lambda *a, **kw: calls.append((a[1].shape, kw["tokens_per_step"]))
                        or decode_attention_dense(*a, **kw))
    model, prompts, params = _small_model_and_requests(tmp_path)

    def run(attention):
        return eqx_tx.generate(model, prompts, params, n=2, share_prefix=False, cache_dtype=cache_dtype,
                               compute=eqx_tx.ComputeConfig(attention=attention, decode_tokens_per_step=64,
                                                            decode_int8_tokens_per_step=32))

    want, got = run("xla"), run("decode_tpu")
    assert calls and all(shape[:2] == (2, 4) for shape, _ in calls)  # [layers, batch, ...]: the whole stack
    assert {tokens for _, tokens in calls} == {64 if cache_dtype is None else 32}  # the cache's dtype's setting
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_shared_prompt_samples_decode_on_the_kernel_as_blockwise(tmp_path, monkeypatch, cache_dtype):
    """`generate(n=3, share_prefix=True)` with `decode_tpu`: every decode step reads
    the prompts' rows (each sample its prompt's) and the samples' own completions in
    place, two kernel calls merged by their log-sum-exps (interpreted); the tokens and
    log-probs equal those of the blockwise shared-prefix path."""
    from eqx_tx.cache import shared_prefix

    calls = []
    monkeypatch.setattr(shared_prefix, "decode_attention_dense_with_lse",
                        lambda *a, **kw: calls.append("own") or decode_attention_dense_with_lse(*a, **kw))
    monkeypatch.setattr(shared_prefix, "decode_attention_shared_with_lse",
                        lambda *a, **kw: calls.append("prompt") or decode_attention_shared_with_lse(*a, **kw))
    model, prompts, params = _small_model_and_requests(tmp_path)

    def run(attention):
        return eqx_tx.generate(model, prompts, params, n=3, share_prefix=True, cache_dtype=cache_dtype,
                               compute=eqx_tx.ComputeConfig(attention=attention))

    want, got = run("xla"), run("decode_tpu")
    assert calls and set(calls) == {"prompt", "own"}
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)


def test_rows_let_queries_share_a_cache_row_and_lse_merges_two_parts():
    """`decode_attention_dense_with_lse(rows=...)`: 4 queries over 2 cache rows (each row read by
    two), with log-sum-exps; merging the halves of a cache read as two caches gives
    attention over the whole (`flash.merge_partials`), against the float64 reference."""
    from eqx_tx.kernels.flash import merge_partials

    L, R, S, K, H, N = 2, 2, 256, 8, 128, 16
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((L, R, S, K, H)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((4, 1, N, H)).astype(np.float32)
    rows, lengths = np.array([0, 0, 1, 1]), np.array([256, 100, 200, 256])
    halves = []
    for part in (slice(0, 128), slice(128, 256)):
        part_lengths = np.clip(lengths - part.start, 0, 128)
        halves.append(decode_attention_dense_with_lse(
            jnp.asarray(q), jnp.asarray(k[:, :, part]), jnp.asarray(v[:, :, part]), jnp.asarray(1),
            jnp.asarray(np.maximum(part_lengths, 1)), rows=jnp.asarray(rows), block=64, interpret=True))
        if part.start:  # a part with no visible key contributes nothing
            halves[-1] = (halves[-1][0], jnp.where(jnp.asarray(part_lengths > 0)[:, None, None], halves[-1][1],
                                                   -jnp.inf))
    out, _ = merge_partials(*halves[0], *halves[1])
    want = _reference(q[:, 0], k[1][rows], v[1][rows], lengths)
    np.testing.assert_allclose(np.asarray(out[:, 0]), want, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("max_query_rows", [128, 32, 1])
def test_samples_of_a_shared_row_read_it_as_one_query_each_would(int8, max_query_rows):
    """`decode_attention_shared_with_lse`: 3 cache rows of 4 samples each, 2 query
    heads per kv head; the samples of a row in one group of 64 query rows, in groups
    of 2, and one by one. Outputs and log-sum-exps equal the float64 reference of each
    sample over its row (int8: over the dequantized row) and `rows=` one query per
    grid row."""
    L, R, S, K, H, N, n = 2, 3, 256, 8, 128, 16, 4
    rng = np.random.default_rng(7)
    k, v = (rng.standard_normal((L, R, S, K, H)).astype(np.float32) * 2 for _ in range(2))
    k, v, scales, kd, vd = _stored(k, v, int8)
    q = rng.standard_normal((R * n, 1, N, H)).astype(np.float32)
    lengths = np.array([256, 1, 130])
    rows = np.arange(R * n) // n
    out, lse = decode_attention_shared_with_lse(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(1),
                                                jnp.asarray(lengths), samples=n, scales=scales,
                                                max_query_rows=max_query_rows, block=64, interpret=True)
    assert out.shape == q.shape and lse.shape == (R * n, 1, N)
    np.testing.assert_allclose(np.asarray(out[:, 0]), _reference(q[:, 0], kd[1][rows], vd[1][rows], lengths[rows]),
                               atol=1e-5)
    one_each = decode_attention_dense_with_lse(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(1),
                                               jnp.asarray(lengths[rows]), scales=scales, rows=jnp.asarray(rows),
                                               block=64, interpret=True)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(one_each[1]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(one_each[0]), atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_runs_of_sequences_read_their_shared_leading_pages_once_and_attend_as_alone(monkeypatch, int8):
    """`decode_attention_blocks_shared`, runs of 4 sequences over a shuffled pool of
    16-token pages: run 0 shares 3 leading pages, but one member's last key lies in the
    third (so 2 are read once for the run), run 1 shares none across all four (two of
    its members share two pages with each other only), run 2 is two sequences sharing
    two pages beside two padding rows (no page: they take no part). Each equals the
    float64 reference over its own table (int8: dequantized) and
    `decode_attention_blocks`."""
    from eqx_tx.kernels import decode_tpu

    read, blocks = [], decode_tpu._blocks
    monkeypatch.setattr(decode_tpu, "_blocks", lambda q, k, v, layer, table, lengths, *a, **kw:
                        read.append(np.asarray(lengths)) or blocks(q, k, v, layer, table, lengths, *a, **kw))
    L, pages, page, K, H, N = 2, 40, 16, 8, 128, 16
    rng = np.random.default_rng(9)
    k, v = (rng.standard_normal((L, pages, page, K, H)).astype(np.float32) * 2 for _ in range(2))
    k, v, scales, kd, vd = _stored(k, v, int8)
    free = iter(rng.permutation(pages).tolist())
    own = lambda n: [next(free) for _ in range(n)]  # noqa: E731
    shared3, shared2, other2 = own(3), own(2), own(2)
    tables = [shared3 + own(2), shared3 + own(1), shared3 + own(2), shared3 + own(1),
              shared2 + own(1), shared2 + own(2), own(3), own(2),
              other2 + own(1), other2 + own(2), [pages] * 5, [pages] * 5]
    table = np.array([t + [pages] * (5 - len(t)) for t in tables])
    lengths = np.array([70, 3 * page, 80, 60, 40, 45, 33, 20, 40, 45, 1, 1])
    q = rng.standard_normal((12, N, H)).astype(np.float32)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(1), jnp.asarray(table), jnp.asarray(lengths))
    out = decode_attention_blocks_shared(*args, rows=4, scales=scales, tokens_per_step=32, interpret=True)
    assert read[0].tolist() == [2 * page, 0, 2 * page]  # the runs' shared keys, then each sequence's own
    assert read[1].tolist() == (lengths - np.array([2 * page] * 4 + [0] * 4 + [2 * page] * 2 + [0] * 2)).tolist()
    gathered = lambda x: np.stack([x[1, row].reshape(-1, K, H) for row in np.minimum(table, pages - 1)])  # noqa: E731
    live = slice(0, 10)
    np.testing.assert_allclose(np.asarray(out)[live], _reference(q, gathered(kd), gathered(vd), lengths)[live],
                               atol=1e-5)
    alone = decode_attention_blocks(*args, scales=scales, tokens_per_step=32, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(alone), atol=1e-5)
    with pytest.raises(ValueError, match="a batch of 12 sequences does not split into runs of 8"):
        decode_attention_blocks_shared(*args, rows=8, interpret=True)


def test_shared_rows_refuse_queries_that_do_not_group():
    q, kv = jnp.zeros((6, 1, 16, 128)), jnp.zeros((1, 2, 128, 8, 128))
    with pytest.raises(ValueError, match="6 queries of 16 heads do not group as 4 samples over 8 kv heads"):
        decode_attention_shared_with_lse(q, kv, kv, jnp.asarray(0), jnp.asarray([1, 1]), samples=4, interpret=True)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_engine_decodes_on_the_kernel_through_its_page_tables(checkpoints, monkeypatch, cache_dtype):
    """The engine's decode steps read the pool's pages in place (kernel interpreted);
    every request equals `generate` alone on the xla path (int8: in an int8 cache
    too), with requests waiting for pages and arriving while others run (the page
    tables change under the kernel)."""
    from eqx_tx.cache import paged
    from tests.test_engine import _assert_equal_to_generate, _workload

    calls = []
    monkeypatch.setattr(paged, "decode_attention_blocks",
                        lambda *a, **kw: calls.append(kw["tokens_per_step"]) or decode_attention_blocks(*a, **kw))
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    requests = _workload(model.config.vocab_size, seed=0)[:4]
    dtype = None if cache_dtype is None else jnp.dtype(cache_dtype)
    engine = eqx_tx.Engine(model, max_seqs=2, max_tokens_in_cache=64, page_size=8, prefill_chunk=16,
                           cache_dtype=dtype, compute=eqx_tx.ComputeConfig(attention="decode_tpu"))
    results = engine.run(requests)
    assert calls and engine.stats()["preemptions"] > 0
    assert set(calls) == {engine.compute.decode_step_tokens(dtype is not None)}
    _assert_equal_to_generate(model, requests, results, cache_dtype=dtype)


def test_engine_samples_of_a_prompt_read_its_pages_once_per_run_and_equal_row_by_row(tmp_path, monkeypatch):
    """`EngineConfig.shared_decode_rows=4` on the kernel (interpreted): the `n=3`
    samples of each of two prompts (20 and 3 tokens, pages of 8) decode in runs of 4
    rows (one a padding row) whose shared prompt pages the kernel reads once per run; every sample's
    tokens and log-probs equal the engine's row by row (`shared_decode_rows=0`), and
    the compiled programs are those `warmup` compiled."""
    from eqx_tx.cache import paged
    from eqx_tx.infer import steps

    calls = []
    monkeypatch.setattr(paged, "decode_attention_blocks_shared",
                        lambda *a, **kw: calls.append(kw["rows"]) or decode_attention_blocks_shared(*a, **kw))
    model, prompts, params = _small_model_and_requests(tmp_path)
    requests = list(zip(prompts, params))[::-1]

    def engine(share):
        return eqx_tx.Engine(model, max_seqs=8, max_tokens_in_cache=256, page_size=8, prefill_chunk=16,
                             shared_decode_rows=share, min_decode_rows=4,  # (fewer shapes for the interpreter)
                             compute=eqx_tx.ComputeConfig(attention="decode_tpu"))

    want = engine(0).run(requests, n=3)
    shared = engine(4)
    shared.warmup()
    compiled = steps.paged_decode_step._cache_size()
    plans, schedule = [], shared.scheduler.schedule
    shared.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    got = shared.run(requests, n=3)
    assert calls and set(calls) == {4} and steps.paged_decode_step._cache_size() == compiled
    assert any(p.decode.share_rows == 4 and len(p.decode.requests) == 6 for p in plans if p.decode is not None)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


@pytest.mark.parametrize("name", ["decode_tokens_per_step", "decode_int8_tokens_per_step"])
def test_tokens_per_step_below_one_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
        eqx_tx.ComputeConfig(**{name: 0})
    assert eqx_tx.ComputeConfig().decode_step_tokens(True) == eqx_tx.ComputeConfig().decode_int8_tokens_per_step


def test_the_kernels_lower_for_a_tpu(monkeypatch):
    """Every form of the kernel (a page pool bf16 and int8, runs of shared pages, a dense
    cache bf16 and int8, a shared prompt's groups) lowers through Pallas's Mosaic rules for a TPU v5e,
    here without one: what the interpreter accepts but Mosaic cannot express fails here,
    before a device session (Mosaic's own compilation still needs the chip)."""
    from jax._src.pallas.mosaic import tpu_info

    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    L, pages, page, K, H, N, B = 2, 64, 128, 8, 128, 16, 8
    S = jax.ShapeDtypeStruct
    q, layer, table, lengths = S((B, N, H), jnp.bfloat16), S((), jnp.int32), S((B, 8), jnp.int32), S((B,), jnp.int32)
    pool, pool8, scale = S((L, pages, page, K, H), jnp.bfloat16), S((L, pages, page, K, H), jnp.int8), S(
        (L, pages, 1, page * K // 128, 128), jnp.float32)
    dense, q1 = S((L, B, 1024, K, H), jnp.bfloat16), S((B, 1, N, H), jnp.bfloat16)
    dense8, dense_scale = S(dense.shape, jnp.int8), S((L, B, 1, 1024 * K // 128, 128), jnp.float32)
    forms = {
        "paged": (lambda *a: decode_attention_blocks(*a, interpret=False), (q, pool, pool, layer, table, lengths)),
        "paged int8": (lambda *a: decode_attention_blocks(*a[:6], scales=a[6:], interpret=False),
                       (q, pool8, pool8, layer, table, lengths, scale, scale)),
        "runs": (lambda *a: decode_attention_blocks_shared(*a, rows=8, interpret=False),
                 (q, pool, pool, layer, table, lengths)),
        "dense": (lambda *a: decode_attention_dense(*a, interpret=False), (q1, dense, dense, layer, lengths)),
        "dense int8": (lambda *a: decode_attention_dense(*a[:5], scales=a[5:], interpret=False),
                       (q1, dense8, dense8, layer, lengths, dense_scale, dense_scale)),
        "shared prompt": (lambda *a: decode_attention_shared_with_lse(*a, samples=8, interpret=False),
                          (q1, S((L, 1, 1024, K, H), jnp.bfloat16), S((L, 1, 1024, K, H), jnp.bfloat16), layer,
                           S((1,), jnp.int32))),
    }
    for name, (f, args) in forms.items():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text, name
