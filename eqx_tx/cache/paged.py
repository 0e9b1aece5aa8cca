"""A paged key/value cache: one pool of fixed-size pages shared by all sequences.

The pool holds `[layers, pages, page_size, kv_heads, head_dim]` keys and values
(int8 with a float32 scale per token and kv head, `[layers, pages, groups, rows,
lanes]`, as `KVCache`). Each sequence owns
the pages its page table lists: position `t` of sequence `b` lives in page
`page_table[b, t // page_size]` at offset `t % page_size`. Page ids equal to the
pool size mark unallocated entries: writes there are dropped and reads are masked
by the sequence's length. Pages are handed out and taken back by the host
(`eqx_tx.infer.engine`), so sequences of any length share one fixed-size pool.

Attention (`eqx_tx.kernels.paged`) walks each sequence's pages block by block up to
the longest sequence's length, gathering them straight from the pool; one query per
sequence runs on the TPU decode kernel (`eqx_tx.kernels.decode_tpu`). A call whose
tokens are groups of rows laid out as one row (`eqx_tx.core.ragged`: the engine's
prefill chunk and decode rows in one step) names its `groups`: each group attends
on its own, through its rows of the page table.
"""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..core.log import log_once
from ..core.ragged import RowGroups, join_tokens, split_rows, split_tokens
from ..core.sharding import AnyMesh, HasAxes
from ..kernels.decode_tpu import decode_attention_blocks, decode_attention_blocks_shared, kernel_options
from ..kernels.dispatch import CacheKind, select_attention
from ..kernels.mask import AttentionMask
from ..kernels.paged import paged_attention
from ..kernels.quantized import Quantized
from .base import AbstractCache
from .storage import KVStorage, put_scale_rows, store_kv, zero_kv

POOL_AXES = ("layers", "cache_pages", "cache_seq", "cache_kv_heads", "head_dim")
POOL_SCALE_AXES = ("layers", "cache_pages", "cache_kv_heads", "cache_seq", None)
TABLE_AXES = ("cache_table", None)


@final
class PagedKVCache(AbstractCache, KVStorage, HasAxes):
    """A page pool of every layer's keys/values and each sequence's page table."""

    k: Array
    v: Array
    k_scale: Float[Array, "layers pages groups rows lanes"] | None
    v_scale: Float[Array, "layers pages groups rows lanes"] | None
    page_table: Int[Array, "batch pages_per_seq"]
    groups: RowGroups | None = eqx.field(static=True)
    share_rows: int = eqx.field(static=True)

    def __init__(self, k, v, k_scale, v_scale, page_table, groups: RowGroups | None = None, share_rows: int = 0):
        self.k = k
        self.v = v
        self.k_scale = k_scale
        self.v_scale = v_scale
        self.page_table = page_table
        self.groups = groups
        self.share_rows = share_rows

    @classmethod
    def zeros(
        cls, *, layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, batch: int,
        pages_per_seq: int, scale_groups: int = 1,
    ) -> "PagedKVCache":
        """An empty pool with every page-table entry unallocated."""
        table = jnp.full((batch, pages_per_seq), pages, jnp.int32)
        return cls(*zero_kv((layers, pages, page_size, kv_heads, head_dim), dtype, scale_groups), table)

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"k": POOL_AXES, "v": POOL_AXES, "k_scale": POOL_SCALE_AXES, "v_scale": POOL_SCALE_AXES,
                "page_table": TABLE_AXES}

    @property
    def kind(self) -> CacheKind:
        return "paged_int8" if self.quantized else "paged"

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def with_table(self, page_table: Int[Array, "batch pages_per_seq"],
                   groups: RowGroups | None = None, *, share_rows: int = 0) -> "PagedKVCache":
        """The same pool read and written through another page table (other sequences).
        `groups`: the next call's tokens are these groups of rows laid out as one row
        (`eqx_tx.core.ragged`; the table has a row per row of all groups).
        `share_rows > 1`: the rows are in runs of that many, and the decode kernel reads
        the leading pages a run shares once for it (`decode_attention_blocks_shared`)."""
        if groups is not None and page_table.shape[0] != sum(rows for rows, _ in groups):
            raise ValueError(f"a page table of {page_table.shape[0]} rows for row groups {groups}")
        if share_rows > 1 and (groups is not None or page_table.shape[0] % share_rows):
            raise ValueError(f"runs of {share_rows} rows in a page table of {page_table.shape[0]} rows"
                             f"{' and row groups' if groups is not None else ''}")
        return PagedKVCache(self.k, self.v, self.k_scale, self.v_scale, page_table, groups, share_rows)

    def pools(self) -> tuple[Array | Quantized, Array | Quantized]:
        """The whole key and value pools, for `eqx_tx.kernels.paged.paged_attention`
        (for an int8 pool `Quantized` pairs whose scales keep the pool's layout: the
        kernel lays out the pages it gathers, not the pool)."""
        if self.scales is not None:
            k_scale, v_scale = self.scales
            return Quantized(self.k, k_scale), Quantized(self.v, v_scale)
        return self.k, self.v

    def write(
        self,
        index: Int[Array, ""],
        k_new: Float[Array, "batch seq kv_heads head_dim"],
        v_new: Float[Array, "batch seq kv_heads head_dim"],
        positions: Int[Array, "batch seq"],
    ) -> "PagedKVCache":
        """Store `k_new, v_new` of layer `index` at `positions` of each sequence
        (positions outside its allocated pages: dropped). Each row's positions are
        consecutive (a decoded token, or a chunk). With `groups`, every group's keys and
        values in one scatter (int8 scales: one a group)."""
        if self.groups is None:
            slots = [_slots(self.page_table, positions, self.page_size, self.num_pages)]
            page, offset = slots[0]
        else:
            slots = [_slots(table, pos, self.page_size, self.num_pages) for table, pos in
                     zip(split_rows(self.page_table, self.groups), split_tokens(positions, self.groups))]
            page, offset = join_tokens([p for p, _ in slots]), join_tokens([o for _, o in slots])

        def put(buf, x):
            return buf.at[index, page, offset].set(x.astype(buf.dtype), mode="drop")

        def put_scale(buf, x):  # group by group: each row's offsets run consecutively within a page
            parts = [x] if self.groups is None else split_tokens(x, self.groups)
            for (page_g, offset_g), x_g in zip(slots, parts):
                buf = put_scale_rows(buf, (index, page_g), offset_g, x_g, self.page_size)
            return buf

        return store_kv(self, put, put_scale, k_new, v_new)

    def attend(self, q, k, v, *, layer, positions, mask: AttentionMask, compute: ComputeConfig,
               mesh: AnyMesh | None):
        """Write into the sequences' pages, then attend over them (`paged_attention`, or
        the decode kernel). With `groups`, every group's keys/values are written first
        (one scatter: the pool is updated in place, never copied), then each group
        attends on its own (its rows of the table, of `mask.kv_lengths` and of
        `mask.q_offset`)."""
        assert mask.kv_lengths is not None
        with jax.named_scope("cache_write"):
            cache = self.write(layer, k, v, positions)
        if self.groups is None:
            return cache._read(q, k.shape, layer=layer, positions=positions, mask=mask, compute=compute,
                               mesh=mesh), cache
        groups, outs = self.groups, []
        assert not isinstance(mask.q_offset, int)
        for q_g, k_g, pos_g, table, lengths, offset in zip(
                split_tokens(q, groups), split_tokens(k, groups), split_tokens(positions, groups),
                split_rows(self.page_table, groups), split_rows(mask.kv_lengths, groups),
                split_rows(mask.q_offset, groups)):
            outs.append(cache.with_table(table)._read(q_g, k_g.shape, layer=layer, positions=pos_g,
                                                      mask=AttentionMask(kv_lengths=lengths, q_offset=offset),
                                                      compute=compute, mesh=mesh))
        return join_tokens(outs), cache

    def _read(self, q, k_shape, *, layer, positions, mask: AttentionMask, compute: ComputeConfig,
              mesh: AnyMesh | None):
        """Attention of `q` over the sequences' pages (written already), by the kernel
        `select_attention` picks for these shapes."""
        choice = select_attention(q.shape, k_shape, q.dtype, cache=self.kind, q_offset=mask.q_offset, mesh=mesh,
                                  compute=compute, segmented=mask.segment_ids is not None, page_size=self.page_size)
        assert mask.kv_lengths is not None
        if choice.backend == "decode_tpu":  # one query per sequence: its pages read in place
            lengths = jnp.minimum(positions[:, 0] + 1, mask.kv_lengths)
            options = kernel_options(compute, quantized=self.scales is not None)
            if self.share_rows > 1:  # a run's shared leading pages read once for it
                return decode_attention_blocks_shared(q[:, 0], *self.values(), layer, self.page_table, lengths,
                                                      rows=self.share_rows, scales=self.scales, **options)[:, None]
            o = decode_attention_blocks(q[:, 0], *self.values(), layer, self.page_table, lengths, scales=self.scales,
                                        **options)
            return o[:, None]
        if self.share_rows > 1:
            log_once(f"engine decode: runs of shared pages read row by row ({choice.backend} attention; only the TPU "
                     "decode kernel reads a run's shared pages once)")
        return paged_attention(q, *self.pools(), layer, self.page_table, mask.kv_lengths, positions)


def _slots(table: Int[Array, "batch pages_per_seq"], positions: Int[Array, "batch seq"], page_size: int,
           num_pages: int) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
    """The page and offset of each position through `table` (outside the table: page
    `num_pages`, whose writes are dropped)."""
    slot = positions // page_size
    inside = (positions >= 0) & (slot < table.shape[1])
    page = jnp.take_along_axis(table, jnp.clip(slot, 0, table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, num_pages), positions % page_size
