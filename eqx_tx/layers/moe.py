"""Sparse mixture-of-experts MLP: softmax router, top-k, experts run on grouped rows.

The experts run through the grouped matmul of `eqx_tx.kernels.grouped_ffn` (no
dense `[tokens, experts, hidden]` intermediate). Experts are stacked `[experts, ...]`
(`experts.gate_proj.weight` is `[experts, moe_intermediate, hidden]`, HF's
`mlp.experts.{e}.gate_proj.weight` for each `e`).

With an `ep` axis on the mesh passed in, the experts are split over it: inside
`shard_map` each device gathers its data-parallel group's tokens over `ep`, computes
the rows that go to its own experts, and the partial outputs are reduce-scattered back.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core.sharding import AnyMesh, logical_to_spec, mesh_axis_size
from ..core.tree import stacked
from ..kernels.grouped_ffn import grouped_ffn
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
    experts: GatedMLP = eqx.field(metadata=stacked("experts"))  # every weight has a leading expert axis
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

    @staticmethod
    def _expert_weights(experts: GatedMLP):
        return experts.gate_proj.weight, experts.up_proj.weight, experts.down_proj.weight

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        token_mask: Bool[Array, "batch seq"] | None = None,
        *,
        mesh: AnyMesh | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], RouterStats]:
        """**Arguments:**

        - `x`: the normalised hidden states.
        - `token_mask`: the tokens counted in the router statistics (default: all).
        - `mesh`: the mesh being run on; with an `ep` axis the experts are split over it.

        **Returns:** the MoE output and this layer's `RouterStats`.
        """
        B, T, D = x.shape
        if mesh is not None and mesh_axis_size(mesh, "ep") > 1:
            y, probs, experts = self._expert_parallel(x, mesh)
        else:
            flat = x.reshape(B * T, D)
            _, probs, weights, experts = self.route(flat)
            y = grouped_ffn(flat, weights, experts, *self._expert_weights(self.experts)).reshape(B, T, D)
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
            y = grouped_ffn(flat, weights, experts_idx, *self._expert_weights(experts), first)
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
