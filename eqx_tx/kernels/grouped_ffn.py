"""Grouped expert matmuls: each block of rows multiplied by one expert's weights.

Token-expert assignments are sorted by expert and padded per expert to whole
blocks, so each block of rows belongs to one expert: there is never a dense
`[tokens, experts, hidden]` intermediate. (`jax.lax.ragged_dot` would say the same
in one op, but XLA here lowers it to a dense `[experts, rows, hidden]` computation:
16 GiB per projection at Qwen3-30B-A3B's size.) The block loop has a custom VJP that
recomputes each block's activations and skips weight gradients for frozen experts.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.util import ceil_div, round_up


def grouped_ffn(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens top_k"],
    experts_idx: Int[Array, "tokens top_k"],
    w_gate: Float[Array, "experts inner hidden"],
    w_up: Float[Array, "experts inner hidden"],
    w_down: Float[Array, "experts hidden inner"],
    first: int | Int[Array, ""] = 0,
) -> Float[Array, "tokens hidden"]:
    """`sum_k w_k * expert_k(x)` of gated (SwiGLU) experts, over the assignments to the
    experts held here: `[first, first + count)`, `count` the leading axis of the weights.

    The assignments are sorted by expert and each expert's rows padded to whole
    blocks, so every block belongs to one expert (`_block_ffn`): memory stays
    `O(tokens * top_k * hidden)`, never `[rows, experts, hidden]`.
    """
    N, D = x.shape
    k = experts_idx.shape[-1]
    count = w_gate.shape[0]
    M = N * k
    block = int(min(128, max(8, 1 << max(0, (ceil_div(M, count) - 1).bit_length()))))
    flat_e = experts_idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token = order // k
    local = flat_e[order] - first  # this shard's expert of each sorted row
    mine = (local >= 0) & (local < count)
    local = jnp.where(mine, local, count)
    sizes = jnp.bincount(local, length=count + 1)[:count]
    padded = round_up(sizes, block)
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    row_start = jnp.cumsum(sizes) - sizes
    n_blocks = ceil_div(M, block) + count  # a static bound on the blocks used
    safe = jnp.minimum(local, count - 1)
    dest = jnp.where(mine, pad_start[safe] + (jnp.cumsum(mine) - 1) - row_start[safe], n_blocks * block)
    x_pad = jnp.zeros((n_blocks * block, D), x.dtype).at[dest].set(x[token], mode="drop")
    block_expert = jnp.searchsorted(pad_end, jnp.arange(n_blocks) * block, side="right").astype(jnp.int32)
    used = (pad_end[-1] // block).astype(jnp.int32)
    w = (w_gate, w_up, w_down)
    y_pad = _block_ffn((w, x_pad), block_expert, used, _Block(block))
    out = jnp.take(y_pad, dest, axis=0, mode="fill", fill_value=0)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((N, D), out.dtype).at[token].add(out)


@dataclasses.dataclass(frozen=True)
class _Block:
    size: int


def _silu_grad(g):
    s = jax.nn.sigmoid(g)
    return s * (1 + g * (1 - s))


def _expert_block(w, x_pad, e, j, b):
    wg, wu, wd = (jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False) for a in w)
    xb = jax.lax.dynamic_slice_in_dim(x_pad, j * b, b, 0)
    g = jnp.einsum("bd,id->bi", xb, wg, preferred_element_type=jnp.float32)
    u = jnp.einsum("bd,id->bi", xb, wu, preferred_element_type=jnp.float32)
    return wg, wu, wd, xb, g, u


def _block_ffn_forward(w, x_pad, block_expert, used, blk: _Block):
    b = blk.size

    def body(j, y_pad):
        wg, wu, wd, xb, g, u = _expert_block(w, x_pad, block_expert[j], j, b)
        h = (jax.nn.silu(g) * u).astype(x_pad.dtype)
        y = jnp.einsum("bi,di->bd", h, wd, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(y_pad, y.astype(y_pad.dtype), j * b, 0)

    return jax.lax.fori_loop(0, used, body, jnp.zeros_like(x_pad))


@eqx.filter_custom_vjp
def _block_ffn(w_x, block_expert, used, blk: _Block):
    """The gated MLP of expert `block_expert[j]` on rows `[j*b, (j+1)*b)`, for the `used`
    blocks (a loop: one small matmul chain per block). The backward pass recomputes
    each block's activations and skips weight gradients for frozen experts."""
    w, x_pad = w_x
    return _block_ffn_forward(w, x_pad, block_expert, used, blk)


@_block_ffn.def_fwd
def _block_ffn_fwd(perturbed, w_x, block_expert, used, blk):
    w, x_pad = w_x
    return _block_ffn_forward(w, x_pad, block_expert, used, blk), None


@_block_ffn.def_bwd
def _block_ffn_bwd(_, dy_pad, perturbed, w_x, block_expert, used, blk):
    w, x_pad = w_x
    b = blk.size
    w_perturbed, _ = perturbed
    need_w = any(jax.tree.leaves(w_perturbed))

    def body(j, carry):
        dx_pad, dw = carry
        e = block_expert[j]
        wg, wu, wd, xb, g, u = _expert_block(w, x_pad, e, j, b)
        act = jax.nn.silu(g)
        dy = jax.lax.dynamic_slice_in_dim(dy_pad, j * b, b, 0)
        dh = jnp.einsum("bd,di->bi", dy, wd, preferred_element_type=jnp.float32)
        dg = dh * u * _silu_grad(g)
        du = dh * act
        dx = jnp.einsum("bi,id->bd", dg.astype(wg.dtype), wg, preferred_element_type=jnp.float32)
        dx = dx + jnp.einsum("bi,id->bd", du.astype(wu.dtype), wu, preferred_element_type=jnp.float32)
        dx_pad = jax.lax.dynamic_update_slice_in_dim(dx_pad, dx.astype(dx_pad.dtype), j * b, 0)
        if need_w:
            h = (act * u).astype(x_pad.dtype)
            updates = (
                jnp.einsum("bi,bd->id", dg, xb, preferred_element_type=jnp.float32),
                jnp.einsum("bi,bd->id", du, xb, preferred_element_type=jnp.float32),
                jnp.einsum("bd,bi->di", dy, h, preferred_element_type=jnp.float32),
            )
            dw = tuple(
                jax.lax.dynamic_update_index_in_dim(acc, jax.lax.dynamic_index_in_dim(acc, e, 0, False) + upd, e, 0)
                for acc, upd in zip(dw, updates)
            )
        return dx_pad, dw

    dw0 = tuple(jnp.zeros(a.shape, jnp.float32) for a in w) if need_w else ()
    dx_pad, dw = jax.lax.fori_loop(0, used, body, (jnp.zeros_like(x_pad), dw0))
    dw = tuple(d.astype(a.dtype) for d, a in zip(dw, w)) if need_w else (None, None, None)
    return dw, dx_pad
