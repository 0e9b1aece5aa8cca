"""`select_attention`: the one place an attention path is chosen, and why."""

import jax
import jax.numpy as jnp
import pytest

from eqx_tx.core.compute import ComputeConfig
from eqx_tx.core.sharding import make_mesh
from eqx_tx.kernels.dispatch import AUTO_BLOCKWISE_MIN_SCORES, select_attention

Q = (2, 16, 4, 8)  # batch, q_seq, heads, head_dim
K = (2, 16, 2, 8)


def _choose(cache="none", q=Q, k=K, mesh=None, q_offset=0, **compute):
    return select_attention(q, k, jnp.float32, cache=cache, q_offset=q_offset, mesh=mesh,
                            compute=ComputeConfig(**compute))


def test_auto_picks_xla_for_small_scores_and_blockwise_for_large_on_cpu():
    small = _choose()
    assert small.backend == "xla" and "backend is cpu" in small.reason
    side = int(AUTO_BLOCKWISE_MIN_SCORES**0.5)
    large = _choose(q=(2, side, 4, 8), k=(2, side, 2, 8))
    assert large.backend == "blockwise" and "backend is cpu" in large.reason


def test_requested_kernels_run_or_refuse_with_the_reason():
    assert _choose(attention="blockwise").backend == "blockwise"
    assert _choose(attention="xla").backend == "xla"
    with pytest.raises(ValueError, match="'cudnn' cannot run: backend is cpu"):
        _choose(attention="cudnn")


def test_cache_kinds():
    assert _choose("int8").backend == "blockwise"  # read block by block
    assert _choose("int8", attention="xla").backend == "xla"  # the reference dequantizes whole
    with pytest.raises(ValueError, match="cannot read an int8 KV cache"):
        _choose("int8", attention="cudnn")
    assert _choose("shared_prefix", attention="xla").backend == "shared_prefix"
    assert _choose("dense", q_offset=jnp.zeros((2,), jnp.int32)).backend == "xla"


def test_context_parallel_mesh_means_ring_without_a_cache_only():
    mesh = make_mesh(dp=1, sp=2, tp=1, devices=jax.devices()[:2])
    assert _choose(mesh=mesh).backend == "ring"
    assert _choose(mesh=mesh, attention="xla").backend == "ring"
    assert _choose("dense", mesh=mesh).backend == "xla"  # decode reads a cache: no ring
    no_sp = make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    assert _choose(mesh=no_sp).backend == "xla"


def test_segment_ids_take_blockwise_where_cudnn_would_run(monkeypatch):
    from eqx_tx.kernels import dispatch

    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "gpu")  # as compiling for a GPU

    def choose(**kw):
        return select_attention(Q, K, jnp.bfloat16, cache="none", q_offset=0, mesh=None, **kw)

    assert choose(compute=ComputeConfig()).backend == "cudnn"
    for requested in ("auto", "cudnn"):
        packed = choose(compute=ComputeConfig(attention=requested), segmented=True)
        assert packed.backend == "blockwise" and "segment ids" in packed.reason
    assert choose(compute=ComputeConfig(attention="xla"), segmented=True).backend == "xla"
    with pytest.raises(ValueError, match="without a KV cache"):
        select_attention(Q, K, jnp.bfloat16, cache="dense", q_offset=0, mesh=None, compute=ComputeConfig(),
                         segmented=True)


def test_tile_sizes_are_the_platforms_unless_configured(monkeypatch):
    from eqx_tx.kernels import dispatch

    cpu = _choose(attention="blockwise")
    assert (cpu.block_q, cpu.block_kv) == dispatch.DEFAULT_BLOCKS["cpu"]
    configured = _choose(attention="blockwise", block_q=64, block_kv=32)
    assert (configured.block_q, configured.block_kv) == (64, 32)
    monkeypatch.setattr(dispatch, "target_platform", lambda mesh: "gpu")
    gpu = _choose(attention="blockwise")
    assert (gpu.block_q, gpu.block_kv) == dispatch.DEFAULT_BLOCKS["gpu"] != dispatch.DEFAULT_BLOCKS["cpu"]


def test_a_page_pool_is_read_by_the_paged_kernel_and_a_refused_request_is_logged(eqx_log):
    """The paged cache goes through select_attention like every other path: `auto`
    picks the paged kernel, and another requested implementation (which cannot read a
    page pool) is not silently ignored: the reason names it, once in the log."""
    assert _choose("paged").backend == "paged"
    choice = _choose("paged", attention="xla", q=(2, 1, 4, 8))
    assert choice.backend == "paged" and "requested xla, which cannot read a page pool" in choice.reason
    assert any("requested xla, which cannot read a page pool" in m for m in eqx_log)
