"""How KV caches are stored and written. A bf16 KV cache on XLA:CPU is stored as its
uint16 bit patterns: written and read as a bf16 cache would be, without converting the
whole buffer on each write or read. A dense cache takes a long chunk as one window per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from eqx_tx.cache.allocate import new_cache, new_paged_cache
from eqx_tx.cache.dense import WINDOW_TOKENS
from eqx_tx.cache.storage import put_scale_rows
from eqx_tx.kernels.paged import paged_attention
from eqx_tx.kernels.quantized import Quantized, scales_by_token, stored_scales


class _Shape:
    num_hidden_layers, num_key_value_heads, head_dim = 2, 2, 32


def _new(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_a_dense_bf16_cache_is_stored_as_bits_and_reads_as_bf16():
    rng = np.random.default_rng(0)
    k_new, v_new = _new(rng, 3, 5, 2, 32), _new(rng, 3, 5, 2, 32)
    positions = jnp.asarray([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [3, 4, 5, 6, 7]])
    bf16, f32 = (new_cache(_Shape(), 3, 16, dtype) for dtype in (jnp.bfloat16, jnp.float32))
    assert bf16.k.dtype == jnp.uint16 and bf16.dtype == jnp.bfloat16 and f32.k.dtype == jnp.float32
    bf16 = bf16.write(jnp.asarray(1), k_new, v_new, positions)
    f32 = f32.write(jnp.asarray(1), k_new.astype(jnp.bfloat16), v_new.astype(jnp.bfloat16), positions)
    for got, want in zip(bf16.layer(1) + bf16.values(), f32.layer(1) + f32.values()):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want))


def test_a_paged_bf16_pool_is_written_and_read_without_converting_the_whole_pool():
    rng = np.random.default_rng(1)
    table = jnp.asarray([[5, 2, 7, 8], [1, 0, 8, 8]])  # 8: unallocated
    positions = jnp.asarray([[9, 10, 11], [4, 5, 6]])
    k_new, v_new = _new(rng, 2, 3, 2, 32), _new(rng, 2, 3, 2, 32)
    pools = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        cache = new_paged_cache(_Shape(), pages=8, page_size=4, batch=2, pages_per_seq=4, dtype=dtype)
        cache = cache.with_table(table)
        rounded = [x.astype(jnp.bfloat16).astype(dtype) for x in (k_new, v_new)]  # the float32 pool holds bf16's values
        pools[dtype] = cache.write(jnp.asarray(1), *rounded, positions)
    assert pools[jnp.bfloat16].k.dtype == jnp.uint16
    q = _new(rng, 2, 1, 4, 32)
    lengths = positions[:, -1] + 1

    def read(cache):
        return paged_attention(q, *cache.pools(), jnp.asarray(1), table, lengths, positions[:, -1:])

    np.testing.assert_array_equal(np.asarray(read(pools[jnp.bfloat16])), np.asarray(read(pools[jnp.float32])))
    # Neither the write nor the read converts the pool `[2, 8, 4, 2, 32]` (XLA:CPU did, to float32 and back).
    cache = pools[jnp.bfloat16]
    write = jax.jit(lambda c: c.write(jnp.asarray(1), k_new, v_new, positions)).lower(cache).compile().as_text()
    assert "[2,8,4,2,32]" in write and "f32[2,8,4,2,32]" not in write and "bf16[2,8,4,2,32]" not in write
    text = jax.jit(read).lower(cache).compile().as_text()
    assert "f32[2,8,4,2,32]" not in text and "bf16[2,8,4,2,32]" not in text


@pytest.mark.parametrize("seq", [5, WINDOW_TOKENS])
def test_a_dense_cache_writes_a_chunk_per_token_or_per_row(seq):
    """A chunk's rows land at their positions (a row wholly past the end: dropped) in
    every storage (float32, bf16 bits, int8 values with their scales in rows of 128): token by
    token below `WINDOW_TOKENS` (int8 scales: whole rows of 128 lanes), else as one scatter
    of a window per row."""
    rng = np.random.default_rng(2)
    B, L, K, D = 3, 3 * seq, 2, 32
    starts = np.asarray([0, L - seq - 1, L])  # the third row is wholly outside the cache
    positions = jnp.asarray(starts[:, None] + np.arange(seq))
    k_new, v_new = _new(rng, B, seq, K, D), _new(rng, B, seq, K, D)
    for dtype in (jnp.float32, jnp.bfloat16, "int8"):
        cache = new_cache(_Shape(), B, L, dtype)
        written = cache.write(jnp.asarray(1), k_new, v_new, positions)
        for new, stored, scales in ((k_new, written.k, written.k_scale), (v_new, written.v, written.v_scale)):
            want = np.zeros((B, L, K, D), np.float32)
            want_scale = np.zeros((B, L, K), np.float32)
            if dtype == "int8":
                q = Quantized.quantize(new)
                values, scale = np.asarray(q.values, np.float32), np.asarray(q.scale)
            else:
                values, scale = np.asarray(new.astype(dtype).astype(jnp.float32)), None
            for b in range(B):
                if starts[b] + seq <= L:
                    want[b, starts[b]:starts[b] + seq] = values[b]
                    if scale is not None:
                        want_scale[b, starts[b]:starts[b] + seq] = scale[b]
            got = stored[1] if dtype != jnp.bfloat16 else jax.lax.bitcast_convert_type(stored[1], jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(got, np.float32), want)
            assert not np.asarray(stored[0], np.float32).any()  # another layer: untouched
            if scales is not None:
                np.testing.assert_array_equal(np.asarray(scales_by_token(scales[1], L, K)), want_scale)
        jaxpr = jax.make_jaxpr(lambda c: c.write(jnp.asarray(1), k_new, v_new, positions))(cache)
        buffers = {x.shape for x in jax.tree.leaves(cache)}
        indices = [e.invars[1].aval.shape for e in jaxpr.eqns
                   if e.primitive.name == "scatter" and e.invars[0].aval.shape in buffers]  # into the cache
        per_write = (B, 3) if seq >= WINDOW_TOKENS else (B, seq, 3)
        # (index, row, scale row): a window per row, or per row of scales a run of 5 can touch (2)
        per_scale = (B, 3) if seq >= WINDOW_TOKENS else (B, 2, 3)
        assert indices == [per_write] * 2 + ([per_scale] * 2 if dtype == "int8" else []), indices


def _scale_oracle(shape, writes):
    """Scales `[rows, tokens, kv_heads]` after `writes` of `(row, position, scale)`
    (a position out of range: dropped), as a plain array."""
    want = np.zeros(shape, np.float32)
    for row, position, scale in writes:
        if 0 <= position < shape[1]:
            want[row, position] = scale
    return want


@pytest.mark.parametrize("L", [200, 256])  # rows of 64 tokens: the last one short, or all whole
def test_a_decode_step_writes_each_rows_scales_whole_and_keeps_its_neighbours(L):
    """Decoded tokens (one per sequence), then a short chunk per sequence, in an int8
    dense cache: each token's scales land at its position, its row's other tokens (in
    the same row of 128 lanes) kept, a token past the end dropped; one row-wide window
    per token, not a window of its heads."""
    rng = np.random.default_rng(3)
    B, K, D = 3, 2, 32  # 64 tokens to a row of scales: rows 0..3
    starts = np.asarray([0, 61, L - 3])  # row 1 crosses a row boundary; row 2 runs past the end
    cache, writes = new_cache(_Shape(), B, L, "int8"), {"k": [], "v": []}
    for t in range(5):
        positions = jnp.asarray(starts[:, None] + t)
        k_new, v_new = _new(rng, B, 1, K, D), _new(rng, B, 1, K, D)
        cache = cache.write(jnp.asarray(1), k_new, v_new, positions)
        for name, new in (("k", k_new), ("v", v_new)):
            scale = np.asarray(Quantized.quantize(new).scale)
            writes[name] += [(b, starts[b] + t, scale[b, 0]) for b in range(B)]
    chunk = jnp.asarray([[60], [120], [L - 6]]) + jnp.arange(6)  # row 0 crosses into scale row 1
    k_chunk, v_chunk = _new(rng, B, 6, K, D), _new(rng, B, 6, K, D)
    cache = cache.write(jnp.asarray(1), k_chunk, v_chunk, chunk)
    for name, new in (("k", k_chunk), ("v", v_chunk)):
        scale = np.asarray(Quantized.quantize(new).scale)
        writes[name] += [(b, int(chunk[b, t]), scale[b, t]) for b in range(B) for t in range(6)]
    for name, scales in (("k", cache.k_scale), ("v", cache.v_scale)):
        np.testing.assert_array_equal(np.asarray(scales_by_token(scales[1], L, K)),
                                      _scale_oracle((B, L, K), writes[name]))
        assert not np.asarray(scales[0]).any()
    jaxpr = jax.make_jaxpr(lambda c: c.write(jnp.asarray(1), k_new, v_new, positions))(cache)
    updates = [e.invars[2].aval.shape for e in jaxpr.eqns
               if e.primitive.name == "scatter" and e.invars[0].aval.shape == cache.k_scale.shape]
    groups, lanes = cache.k_scale.shape[2], cache.k_scale.shape[-1]
    assert updates == [(B, 1, groups, lanes)] * 2, updates  # a whole row of scales per sequence


def test_a_paged_int8_pool_takes_decode_rows_and_mixed_steps():
    """An int8 page pool written by decode steps (one token per sequence, a padding row
    unallocated) and by a mixed step (a prefill chunk and decode rows laid out as one
    row, `RowGroups`): every token's scales where its page table puts it."""
    rng = np.random.default_rng(4)
    pages, page_size, K, D = 8, 64, 2, 32
    table = jnp.asarray([[5, 2, 8], [1, 0, 8], [8, 8, 8]])  # 8: unallocated (row 2: padding)
    cache = new_paged_cache(_Shape(), pages=pages, page_size=page_size, batch=3, pages_per_seq=3,
                            dtype="int8").with_table(table)
    writes = {"k": [], "v": []}

    def record(positions, rows_of_table, k_new, v_new):
        for name, new in (("k", k_new), ("v", v_new)):
            scale = np.asarray(Quantized.quantize(new).scale).reshape(-1, K)
            for (r, p), s in zip(zip(rows_of_table, positions), scale):
                page = int(table[r, p // page_size]) if p // page_size < 3 else pages
                if page < pages:
                    writes[name].append((page, p % page_size, s))

    for t in range(3):  # decode steps; row 0 crosses from its first page to its second
        positions = jnp.asarray([[62 + t], [10 + t], [0]])
        k_new, v_new = _new(rng, 3, 1, K, D), _new(rng, 3, 1, K, D)
        cache = cache.write(jnp.asarray(1), k_new, v_new, positions)
        record([62 + t, 10 + t, 0], [0, 1, 2], k_new, v_new)
    groups = ((1, 4), (2, 1))  # 4 tokens of row 1, across its pages 1 and 0; then rows 0 and 2 decode
    mixed = cache.with_table(jnp.asarray(table)[jnp.asarray([1, 0, 2])], groups)
    positions = jnp.asarray([[62, 63, 64, 65, 65, 0]])
    k_new, v_new = _new(rng, 1, 6, K, D), _new(rng, 1, 6, K, D)
    cache = mixed.write(jnp.asarray(1), k_new, v_new, positions)
    record([62, 63, 64, 65, 65, 0], [1, 1, 1, 1, 0, 2], k_new, v_new)
    for name, scales in (("k", cache.k_scale), ("v", cache.v_scale)):
        np.testing.assert_array_equal(np.asarray(scales_by_token(scales[1], page_size, K)),
                                      _scale_oracle((pages, page_size, K), writes[name]))


def _equations(jaxpr):
    """Every equation of `jaxpr`, those of the programs it calls included."""
    for e in jaxpr.eqns:
        yield e
        for sub in jaxprs_in_params(e.params):
            yield from _equations(sub)


@pytest.mark.parametrize("kv_heads, groups, tokens, seq", [(8, 1, 64, 1), (8, 1, 64, 37), (8, 2, 64, 20), (8, 2, 48, 1),
                                                            (4, 1, 40, 9), (2, 1, 150, 70)])
def test_scale_rows_place_runs_at_any_offset_without_a_gather_of_the_new_scales(kv_heads, groups, tokens, seq):
    """`put_scale_rows` against a plain array, runs starting at every offset into a row
    of scales (and past the end of the axis), for several head counts and groups; where
    rows tile the axis (or a run is one token), the run's scales reach their lanes by
    shifts and selects, not a gather (a serial loop on a TPU)."""
    rng = np.random.default_rng(5)
    R = 2 * tokens
    runs = np.arange(R)
    starts = rng.permutation(np.concatenate([np.arange(tokens), tokens - seq + np.arange(tokens)]))  # [R]
    before = rng.standard_normal((R, tokens, kv_heads)).astype(np.float32)
    x = rng.standard_normal((R, seq, kv_heads)).astype(np.float32)
    positions = starts[:, None] + np.arange(seq)
    scales = stored_scales(jnp.asarray(before), groups)

    def write(s, x):
        return put_scale_rows(s, (jnp.asarray(runs)[:, None],), jnp.asarray(positions), x, tokens)

    got = jax.jit(write)(scales, jnp.asarray(x))
    want = before.copy()
    for r in runs:
        for t in range(seq):
            if 0 <= positions[r, t] < tokens:
                want[r, positions[r, t]] = x[r, t]
    np.testing.assert_array_equal(np.asarray(scales_by_token(got, tokens, kv_heads)), want)
    heads = kv_heads // groups
    if tokens % (scales.shape[-1] // heads) == 0 or seq == 1:
        gathered = [e.invars[0].aval.shape for e in _equations(jax.make_jaxpr(write)(scales, jnp.asarray(x)).jaxpr)
                    if e.primitive.name == "gather"]
        assert set(gathered) <= {scales.shape, positions.shape}, gathered  # rows of scales, positions
