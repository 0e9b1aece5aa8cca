"""Attention over a paged KV cache, walking each sequence's pages block by block.

Keys/values live in a pool `[layers, pages, page_size, kv_heads, head_dim]`
(`eqx_tx.cache.paged`); a page table `[batch, pages_per_seq]` lists each
sequence's pages in order. A `fori_loop` visits blocks of `block_pages` pages up to
the longest sequence's length (a dynamic bound: nothing recompiles as sequences
grow, and no work is done past the longest one), gathers those pages of every
sequence straight from the pool (no contiguous copy of the cache) and folds them
into an online softmax, as the blockwise kernel does.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .flash import online_softmax_step
from .mask import visible
from .quantized import Quantized, as_values, scales_by_token


def paged_attention(
    q: Float[Array, "batch seq heads head_dim"],
    pool_k: Array | Quantized,
    pool_v: Array | Quantized,
    layer: Int[Array, ""],
    page_table: Int[Array, "batch pages_per_seq"],
    kv_lengths: Int[Array, " batch"],
    q_positions: Int[Array, "batch seq"],
    *,
    block_pages: int = 8,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention of `q` over layer `layer` of the pool, through `page_table`.

    **Arguments:**

    - `q`: queries at `q_positions` (RoPE applied).
    - `pool_k`, `pool_v`: `[layers, pages, page_size, kv_heads, head_dim]` (or
      int8 values in a `Quantized` whose scales keep the pool's layout, `[layers,
      pages, groups, rows, lanes]` (`eqx_tx.kernels.quantized`); or bf16 stored as `BITS`: only the
      pages gathered are viewed as bf16).
    - `layer`: the layer to read.
    - `page_table`: each sequence's pages; entries past its length are never read
      unmasked (unallocated ids are clipped into the pool, then masked).
    - `kv_lengths`: keys `[0, kv_lengths[b])` of sequence `b` exist.
    - `block_pages`: pages per loop step.

    **Returns:** the attention output, like `q`. A query sees key `j` iff
    `j < kv_lengths[b]` and `j <= q_positions[b, i]`.
    """
    B, T, N, H = q.shape
    values_k = pool_k.values if isinstance(pool_k, Quantized) else pool_k
    page_size, K = values_k.shape[2], values_k.shape[3]
    G = N // K
    P = page_table.shape[1]
    bp = min(block_pages, P)
    n_blocks_max = -(-P // bp)
    table = jnp.pad(page_table, ((0, 0), (0, n_blocks_max * bp - P)), constant_values=values_k.shape[1])
    S = bp * page_size
    q_btkgh = q.reshape(B, T, K, G, H)
    scale = H**-0.5

    def load(pool, pages):
        """`[B, S, K, H]` keys or values of `pages [B, bp]` in layer `layer`, in q's dtype."""
        if isinstance(pool, Quantized):
            x = Quantized(pool.values[layer, pages], scales_by_token(pool.scale[layer, pages], page_size, K))
            x = x.dequantize(q.dtype)
        else:
            x = as_values(pool[layer, pages]).astype(q.dtype)
        return x.reshape(B, S, K, H)

    def block(j, carry):
        pages = jnp.clip(jax.lax.dynamic_slice_in_dim(table, j * bp, bp, axis=1), 0, values_k.shape[1] - 1)
        k_pos = j * S + jnp.arange(S)
        shown = visible(k_pos=k_pos[None, None, :], kv_lengths=kv_lengths[:, None, None], q_pos=q_positions[:, :, None])
        k_bskh = load(pool_k, pages)
        v_bskh = jnp.where((k_pos[None, :] < kv_lengths[:, None])[:, :, None, None], load(pool_v, pages), 0)
        s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) * scale
        s = jnp.where(shown[:, None, None], s, -jnp.inf)
        return online_softmax_step(carry, s, v_bskh, "bkgts,bskh->bkgth")

    o0 = jnp.zeros((B, K, G, T, H), jnp.float32)
    m0 = jnp.full((B, K, G, T), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((B, K, G, T), jnp.float32)
    n_blocks = jnp.minimum(-(-jnp.max(kv_lengths) // S), n_blocks_max)
    o, _, l = jax.lax.fori_loop(0, n_blocks, block, (o0, m0, l0))
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.moveaxis(o, 3, 1).reshape(B, T, N, H).astype(q.dtype)
