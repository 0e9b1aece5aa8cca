"""Sparse mixture-of-experts MLP: softmax router, top-k, experts run on grouped rows.

Token-expert assignments are sorted by expert and padded per expert to whole
blocks, so each block of rows is multiplied by one expert's weights: there is never
a dense `[tokens, experts, hidden]` intermediate. (`jax.lax.ragged_dot` would say
the same in one op, but XLA here lowers it to a dense `[experts, rows, hidden]`
computation: 16 GiB per projection at Qwen3-30B-A3B's size.) Experts are stacked `[experts, ...]`
(`experts.gate_proj.weight` is `[experts, moe_intermediate, hidden]`, HF's
`mlp.experts.{e}.gate_proj.weight` for each `e`).

With an `ep` mesh axis the experts are split over it: inside `shard_map` each
device gathers its data-parallel group's tokens over `ep`, computes the rows that
go to its own experts, and the partial outputs are reduce-scattered back.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from ..sharding import current_mesh, logical_to_spec
from .linear import Linear
from .mlp import GatedMLP


class RouterStats(eqx.Module):
    """Sufficient statistics of the load-balancing loss, summed over layers and tokens."""

    assigned: Float[Array, "top_k experts"]  # how often each expert is a token's i-th choice
    probability: Float[Array, " experts"]  # router probability mass per expert
    tokens: Float[Array, ""]

    @classmethod
    def zeros(cls, top_k: int, experts: int) -> "RouterStats":
        return cls(jnp.zeros((top_k, experts)), jnp.zeros((experts,)), jnp.zeros(()))

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(self.assigned + other.assigned, self.probability + other.probability,
                           self.tokens + other.tokens)

    def load_balancing_loss(self) -> Float[Array, ""]:
        """Switch-Transformer auxiliary loss, as HF's `load_balancing_loss_func` computes it
        over all layers' router logits (masked by the valid tokens)."""
        count = jnp.maximum(self.tokens, 1.0)
        experts = self.probability.shape[0]
        return experts * jnp.sum((self.assigned / count) * (self.probability / count)[None, :])


class MoE(eqx.Module):
    """`sum_k weight_k * expert_k(x)` over each token's top-k experts."""

    gate: Linear  # the router, [experts, hidden]
    experts: GatedMLP  # every weight has a leading expert axis
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)

    def __init__(self, hidden_size: int, intermediate_size: int, *, num_experts: int, top_k: int,
                 norm_topk_prob: bool, dtype=jnp.float32, key: PRNGKeyArray):
        k_gate, k_experts = jax.random.split(key)
        self.gate = Linear(hidden_size, num_experts, axes=("router", "embed"), dtype=dtype, key=k_gate)
        self.experts = eqx.filter_vmap(
            lambda k: GatedMLP(hidden_size, intermediate_size, dtype=dtype, key=k)
        )(jax.random.split(k_experts, num_experts))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    @property
    def num_experts(self) -> int:
        return self.gate.weight.shape[-2]

    def route(self, x: Float[Array, "tokens hidden"]):
        """Router logits `[tokens, experts]` (float32), top-k weights and expert ids."""
        logits = jnp.einsum("nd,ed->ne", x, self.gate.weight, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, probs, weights.astype(x.dtype), experts

    def __call__(
        self, x: Float[Array, "batch seq hidden"], token_mask=None
    ) -> tuple[Float[Array, "batch seq hidden"], RouterStats]:
        """**Returns:** the MoE output and this layer's `RouterStats` (over the tokens
        where `token_mask` is true; all tokens by default)."""
        B, T, D = x.shape
        mesh = current_mesh()
        ep = 1 if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes)).get("ep", 1)
        if ep > 1:
            y, probs, experts = self._expert_parallel(x, mesh)
        else:
            flat = x.reshape(B * T, D)
            _, probs, weights, experts = self.route(flat)
            y = _grouped_experts(flat, weights, experts, self.experts, 0, self.num_experts).reshape(B, T, D)
            experts = experts.reshape(B, T, self.top_k)
            probs = probs.reshape(B, T, -1)
        valid = jnp.ones((B, T), bool) if token_mask is None else token_mask
        v = valid.astype(jnp.float32)
        one_hot = jax.nn.one_hot(experts, self.num_experts, dtype=jnp.float32)  # [B, T, k, E]: small
        stats = RouterStats(
            jnp.einsum("btke,bt->ke", one_hot, v), jnp.einsum("bte,bt->e", probs, v), jnp.sum(v)
        )
        return y, stats

    def _expert_parallel(self, x, mesh):
        """The expert computation with experts split over `ep`, inside `shard_map`."""
        x_spec = logical_to_spec(("batch", "seq", None), x.shape, mesh)
        expert_specs = jax.tree.map(
            lambda lin: logical_to_spec(("experts", *lin.axes), lin.weight.shape, mesh),
            self.experts, is_leaf=lambda n: isinstance(n, Linear),
        )
        batch_axes = x_spec[0] if isinstance(x_spec[0], tuple) else (x_spec[0],)
        tokens_split = "ep" in batch_axes  # else every ep rank already holds the same tokens
        E = self.num_experts
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        local_count = E // sizes["ep"]
        reduce_tp = ("tp",) if sizes.get("tp", 1) > 1 else ()

        def local(x, gate_w, experts):
            tokens = jax.lax.all_gather(x, "ep", axis=0, tiled=True) if tokens_split else x
            b, t, d = tokens.shape
            flat = tokens.reshape(b * t, d)
            moe = eqx.tree_at(lambda m: m.gate.weight, self, gate_w)
            logits, probs, weights, experts_idx = moe.route(flat)
            first = jax.lax.axis_index("ep") * local_count
            y = _grouped_experts(flat, weights, experts_idx, experts, first, E)
            if reduce_tp:  # the expert MLPs are split over tp: partial sums
                y = jax.lax.psum(y, reduce_tp)
            y = y.reshape(b, t, d)
            if tokens_split:  # each rank keeps its own tokens' sums
                y = jax.lax.psum_scatter(y, "ep", scatter_dimension=0, tiled=True)
                n = x.shape[0]
                mine = jax.lax.axis_index("ep") * n
                own = lambda a: jax.lax.dynamic_slice_in_dim(a.reshape(b, t, -1), mine, n, 0)  # noqa: E731
            else:
                y = jax.lax.psum(y, "ep")
                own = lambda a: a.reshape(b, t, -1)  # noqa: E731
            return y, own(probs), own(experts_idx)

        per_token = P(x_spec[0], x_spec[1], None)
        y, probs, experts = jax.shard_map(
            local, mesh=mesh, in_specs=(x_spec, P(None, None), expert_specs), out_specs=(x_spec, per_token, per_token),
            check_vma=False,
        )(x, self.gate.weight, self.experts)
        return y, probs, experts


def _grouped_experts(x, weights, experts_idx, experts: GatedMLP, first, num_experts: int):
    """`sum_k w_k * expert_k(x)` over the assignments to the experts held here,
    `[first, first + count)` of `num_experts` (`count`: the leading axis of `experts`).

    The assignments are sorted by expert and each expert's rows padded to whole
    blocks, so every block belongs to one expert (`_block_ffn`): memory stays
    `O(tokens * top_k * hidden)`, never `[rows, experts, hidden]`.
    """
    N, D = x.shape
    k = experts_idx.shape[-1]
    count = experts.gate_proj.weight.shape[0]
    M = N * k
    block = int(min(128, max(8, 1 << max(0, (-(-M // count) - 1).bit_length()))))
    flat_e = experts_idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token = order // k
    local = flat_e[order] - first  # this shard's expert of each sorted row
    mine = (local >= 0) & (local < count)
    local = jnp.where(mine, local, count)
    sizes = jnp.bincount(local, length=count + 1)[:count]
    padded = -(-sizes // block) * block
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    row_start = jnp.cumsum(sizes) - sizes
    n_blocks = -(-M // block) + count  # a static bound on the blocks used
    safe = jnp.minimum(local, count - 1)
    dest = jnp.where(mine, pad_start[safe] + (jnp.cumsum(mine) - 1) - row_start[safe], n_blocks * block)
    x_pad = jnp.zeros((n_blocks * block, D), x.dtype).at[dest].set(x[token], mode="drop")
    block_expert = jnp.searchsorted(pad_end, jnp.arange(n_blocks) * block, side="right").astype(jnp.int32)
    used = (pad_end[-1] // block).astype(jnp.int32)
    w = (experts.gate_proj.weight, experts.up_proj.weight, experts.down_proj.weight)
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
