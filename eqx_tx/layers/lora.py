"""Low-rank adapters (LoRA) on the linear projections, in PEFT's layout.

`LoRALinear` keeps the frozen `base_layer` and adds `scaling * lora_B(lora_A(x))`,
where `lora_A: [rank, *in]` and `lora_B: [*out, rank]` are ordinary `Linear`s, so
their pytree paths are PEFT's names (`...q_proj.lora_A.weight`).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .linear import Linear
from .moe import MoE

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


class LoRALinear(eqx.Module):
    """`base_layer(x) + scaling * lora_B(lora_A(x))`."""

    base_layer: Linear
    lora_A: Linear
    lora_B: Linear
    scaling: float = eqx.field(static=True)

    def __init__(self, base_layer: Linear, *, rank: int, alpha: float, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `base_layer`: the frozen projection.
        - `rank`, `alpha`: adapter rank and scale (`scaling = alpha / rank`).
        - `dtype`: adapter dtype (float32 by default, whatever the base dtype).
        - `key`: initialises `lora_A` as PEFT does (Kaiming-uniform, `a=sqrt(5)`);
          `lora_B` starts at zero so the adapter starts as the identity.
        """
        n_in = base_layer.in_ndim
        w = base_layer.weight
        in_shape = w.shape[w.ndim - n_in :]
        out_shape = w.shape[: w.ndim - n_in]
        in_axes = base_layer.axes[len(base_layer.axes) - n_in :]
        out_axes = base_layer.axes[: len(base_layer.axes) - n_in]
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        self.base_layer = base_layer
        self.lora_A = Linear(in_shape, rank, axes=("lora_rank", *in_axes), dtype=dtype, key=key)
        self.lora_A = eqx.tree_at(
            lambda m: m.weight, self.lora_A, jax.random.uniform(key, (rank, *in_shape), dtype, -bound, bound)
        )
        self.lora_B = Linear(rank, out_shape, axes=(*out_axes, "lora_rank"), dtype=dtype, key=key)
        self.lora_B = eqx.tree_at(lambda m: m.weight, self.lora_B, jnp.zeros((*out_shape, rank), dtype))
        self.scaling = alpha / rank

    @property
    def rank(self) -> int:
        return self.lora_A.weight.shape[-1 - self.base_layer.in_ndim]

    def __call__(self, x: Float[Array, "..."]) -> Float[Array, "..."]:
        y = self.base_layer(x)
        return y + (self.scaling * self.lora_B(self.lora_A(x))).astype(y.dtype)

    def merged(self) -> Linear:
        """The base layer with `scaling * B @ A` added to its weight (float32 math)."""
        base = self.base_layer
        a = self.lora_A.weight.astype(jnp.float32)
        b = self.lora_B.weight.astype(jnp.float32)

        def delta(b, a):  # [*out, r] x [r, *in] -> [*out, *in]
            return jnp.tensordot(b, a, axes=1)

        for _ in range(a.ndim - 1 - base.in_ndim):  # stacked layers: map over leading axes
            delta = jax.vmap(delta)
        merged = base.weight.astype(jnp.float32) + self.scaling * delta(b, a)
        return eqx.tree_at(lambda m: m.weight, base, merged.astype(base.weight.dtype))


def _is_lora(x) -> bool:
    return isinstance(x, LoRALinear)


def _target_nodes(model, targets):
    """The projections named in `targets` inside the stacked decoder blocks."""
    layers = model.model.layers
    nodes = []
    for name in targets:
        if name in ATTENTION_TARGETS:
            nodes.append(getattr(layers.self_attn, name))
        elif name in MLP_TARGETS:
            if isinstance(layers.mlp, MoE):
                raise ValueError(f"LoRA target {name!r}: this model's MLP is a mixture of experts; "
                                 f"adapters go on the attention projections {ATTENTION_TARGETS}")
            nodes.append(getattr(layers.mlp, name))
        else:
            raise ValueError(f"unknown LoRA target {name!r}; choose from {ALL_TARGETS}")
    return nodes


def apply_lora(model, *, rank: int, alpha: float, targets=ALL_TARGETS, dtype=jnp.float32, key: PRNGKeyArray):
    """Wrap the `targets` projections of every layer in `LoRALinear` adapters.

    **Arguments:**

    - `model`: a `CausalLM` without adapters.
    - `rank`, `alpha`: adapter rank and scale.
    - `targets`: projection names (`q_proj`, ..., `down_proj`).
    - `dtype`: adapter dtype.
    - `key`: initialisation key.

    **Returns:** the model with adapters; see `lora_filter` to train only them.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    targets = tuple(dict.fromkeys(targets))
    nodes = _target_nodes(model, targets)
    if any(_is_lora(n) for n in nodes):
        raise ValueError("model already has LoRA adapters")
    num_layers = model.config.num_hidden_layers
    wrapped = []
    for node, k in zip(nodes, jax.random.split(key, len(nodes))):
        make = lambda base, k: LoRALinear(base, rank=rank, alpha=alpha, dtype=dtype, key=k)  # noqa: E731
        wrapped.append(eqx.filter_vmap(make)(node, jax.random.split(k, num_layers)))
    return eqx.tree_at(lambda m: _target_nodes(m, targets), model, wrapped)


def lora_filter(model):
    """A filter spec (bool pytree) that is `True` exactly on the adapter weights."""
    spec = jax.tree.map(lambda _: False, model)
    loras = [n for n in jax.tree.leaves(model, is_leaf=_is_lora) if _is_lora(n)]

    def where(s):
        found = [n for n in jax.tree.leaves(s, is_leaf=_is_lora) if _is_lora(n)]
        return [x for n in found for x in (n.lora_A.weight, n.lora_B.weight)]

    return eqx.tree_at(where, spec, [True] * (2 * len(loras)))


def has_lora(model) -> bool:
    return any(_is_lora(n) for n in jax.tree.leaves(model, is_leaf=_is_lora))


def merge_lora(model):
    """Fold every adapter into its base weight; returns a plain model."""
    return jax.tree.map(lambda n: n.merged() if _is_lora(n) else n, model, is_leaf=_is_lora)


def lora_settings(model) -> dict:
    """`rank`, `alpha` and `targets` of the adapters in `model`."""
    layers = model.model.layers
    found = {}
    names = ATTENTION_TARGETS if isinstance(layers.mlp, MoE) else ALL_TARGETS
    for name in names:
        parent = layers.self_attn if name in ATTENTION_TARGETS else layers.mlp
        node = getattr(parent, name)
        if _is_lora(node):
            found[name] = node
    if not found:
        raise ValueError("model has no LoRA adapters")
    first = next(iter(found.values()))
    return {"rank": first.rank, "alpha": first.scaling * first.rank, "targets": tuple(found)}
