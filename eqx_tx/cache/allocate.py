"""Empty caches, created directly in their shardings (or as sharded shapes).

The allocation is jitted once per (sizes, mesh): a new jit per cache would compile
again on every `generate` call.
"""

import functools
from collections.abc import Callable
from typing import Protocol

import jax

from ..core.sharding import RULES, abstract_with_shardings, mesh_axis_size, tree_shardings
from ..kernels.dispatch import target_platform
from .dense import KVCache
from .paged import PagedKVCache
from .storage import scale_groups, storage_dtype


class CacheShape(Protocol):
    """What a cache's size is read from (a model's `TransformerConfig`)."""

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def new_cache(
    config: CacheShape, batch: int, max_len: int, dtype, *, mesh=None, abstract: bool = False
) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens, created directly
    in its sharding on `mesh` (kv heads over `tp`, batch over `dp`).

    **Arguments:**

    - `config`: the model's architecture (`TransformerConfig`).
    - `batch`, `max_len`: the cache's size.
    - `dtype`: the keys' and values' dtype; `int8` stores int8 values with float32
      scales; bf16 is stored as its bit patterns when the mesh is on CPU
      (`storage_dtype`).
    - `mesh`: place (or describe) the cache on this mesh (`None`: one device).
    - `abstract`: return sharded `jax.ShapeDtypeStruct`s instead of arrays (for
      compile-only memory analysis).
    """
    return _placed(KVCache.zeros, dict(layers=config.num_hidden_layers, batch=batch, max_len=max_len,
                                       kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                       dtype=storage_dtype(dtype, target_platform(mesh)),
                                       scale_groups=_scale_groups(config, mesh)), mesh, abstract)


def new_paged_cache(
    config: CacheShape, *, pages: int, page_size: int, batch: int, pages_per_seq: int, dtype, mesh=None,
    abstract: bool = False,
) -> PagedKVCache:
    """An empty page pool of `pages` pages of `page_size` tokens and an unallocated
    page table for `batch` sequences of up to `pages_per_seq` pages, placed like
    `new_cache` (kv heads over `tp`)."""
    return _placed(PagedKVCache.zeros, dict(layers=config.num_hidden_layers, pages=pages, page_size=page_size,
                                            kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                            dtype=storage_dtype(dtype, target_platform(mesh)), batch=batch,
                                            pages_per_seq=pages_per_seq, scale_groups=_scale_groups(config, mesh)),
                   mesh, abstract)


def _scale_groups(config: CacheShape, mesh) -> int:
    """An int8 cache's scale groups: one per device along the mesh axes its kv heads
    split over (`eqx_tx.kernels.quantized`)."""
    return scale_groups(config.num_key_value_heads, mesh_axis_size(mesh, RULES["cache_kv_heads"]))


def _placed(zeros: Callable, sizes: dict, mesh, abstract: bool):
    """`zeros(**sizes)` created in its sharding on `mesh`, or as sharded shapes if `abstract`."""
    if abstract:
        shapes = jax.eval_shape(functools.partial(zeros, **sizes))
        return shapes if mesh is None else abstract_with_shardings(shapes, mesh)
    return _allocator(zeros, tuple(sizes.items()), mesh)()


@functools.lru_cache(maxsize=64)
def _allocator(zeros: Callable, sizes: tuple, mesh) -> Callable:
    """`zeros` of `sizes`, jitted once per (sizes, mesh): a new jit per cache would
    compile again on every `generate` call (~30 ms on CPU)."""
    make = functools.partial(zeros, **dict(sizes))
    shardings = None if mesh is None else tree_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=shardings)
