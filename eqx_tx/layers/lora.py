"""Low-rank adapters (LoRA) on the linear projections, in PEFT's layout.

`LoRALinear` keeps the frozen `base_layer` and adds `scaling * lora_B(lora_A(x))`,
where `lora_A: [rank, *in]` and `lora_B: [*out, rank]` are ordinary `Linear`s, so
their pytree paths are PEFT's names (`...q_proj.lora_A.weight`).
"""

import dataclasses
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


def _projections(
    model, names: tuple[str, ...], *, experts: bool = False
) -> list[tuple[tuple[str, ...], Linear | LoRALinear]]:
    """`(path, node)` of every projection (`Linear` or `LoRALinear`) in `model` whose
    attribute name is in `names`, found by module type wherever it sits, in the order
    of `names`. A named projection inside an MoE layer is an error (`experts=False`)
    or skipped (`experts=True`)."""
    found = []

    def visit(node, path: tuple[str, ...], in_moe: bool):
        if isinstance(node, (Linear, LoRALinear)):
            if path and path[-1] in names:
                if in_moe and experts:
                    return
                if in_moe:
                    raise ValueError(f"LoRA target {path[-1]!r}: this model's MLP is a mixture of experts; "
                                     f"adapters go on the attention projections {ATTENTION_TARGETS}")
                found.append((path, node))
            return
        if isinstance(node, eqx.Module):
            for f in dataclasses.fields(node):
                child = getattr(node, f.name, None)
                if isinstance(child, eqx.Module):
                    visit(child, path + (f.name,), in_moe or isinstance(node, MoE))

    visit(model, (), False)
    return sorted(found, key=lambda item: names.index(item[0][-1]))


def _get(tree, path: tuple[str, ...]):
    for name in path:
        tree = getattr(tree, name)
    return tree


def apply_lora(model, *, rank: int, alpha: float, targets=ALL_TARGETS, dtype=jnp.float32, key: PRNGKeyArray):
    """Wrap the `targets` projections of every layer in `LoRALinear` adapters.

    **Arguments:**

    - `model`: a model without adapters (any module tree; projections are found by
      type and attribute name).
    - `rank`, `alpha`: adapter rank and scale.
    - `targets`: projection names (`q_proj`, ..., `down_proj`).
    - `dtype`: adapter dtype.
    - `key`: initialisation key.

    **Returns:** the model with adapters; see `lora_filter` to train only them.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    targets = tuple(dict.fromkeys(targets))
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target {unknown[0]!r}; choose from {ALL_TARGETS}")
    found = _projections(model, targets)
    if any(_is_lora(node) for _, node in found):
        raise ValueError("model already has LoRA adapters")
    if not found:
        raise ValueError(f"no projection named {targets} in the model")
    wrapped = []
    for (_, node), k in zip(found, jax.random.split(key, len(found))):
        assert isinstance(node, Linear)
        make = lambda base, k: LoRALinear(base, rank=rank, alpha=alpha, dtype=dtype, key=k)  # noqa: E731
        stacked_shape = node.weight.shape[: node.weight.ndim - len(node.axes)]  # e.g. (layers,)
        for _ in stacked_shape:
            make = eqx.filter_vmap(make)
        keys = jax.random.split(k, math.prod(stacked_shape)).reshape(stacked_shape) if stacked_shape else k
        wrapped.append(make(node, keys))
    paths = [path for path, _ in found]
    return eqx.tree_at(lambda m: [_get(m, p) for p in paths], model, wrapped)


def lora_filter(model):
    """A filter spec (bool pytree) that is `True` exactly on the adapter weights."""
    spec = jax.tree.map(lambda _: False, model)
    loras = [n for n in jax.tree.leaves(model, is_leaf=_is_lora) if _is_lora(n)]

    def where(s):
        found = [n for n in jax.tree.leaves(s, is_leaf=_is_lora) if _is_lora(n)]
        return [x for n in found for x in (n.lora_A.weight, n.lora_B.weight)]

    return eqx.tree_at(where, spec, [True] * (2 * len(loras)))


def trainable_filter(model):
    """What trains by default: the LoRA adapters if `model` has any, else every array
    (concrete or `jax.ShapeDtypeStruct`)."""
    spec = lora_filter(model)
    if any(jax.tree.leaves(spec)):
        return spec
    return lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def has_lora(model) -> bool:
    return any(_is_lora(n) for n in jax.tree.leaves(model, is_leaf=_is_lora))


def merge_lora(model):
    """Fold every adapter into its base weight; returns a plain model."""
    return jax.tree.map(lambda n: n.merged() if _is_lora(n) else n, model, is_leaf=_is_lora)


def lora_settings(model) -> dict:
    """`rank`, `alpha` and `targets` of the adapters in `model`."""
    found = {path[-1]: node for path, node in _projections(model, ALL_TARGETS, experts=True) if isinstance(node, LoRALinear)}
    if not found:
        raise ValueError("model has no LoRA adapters")
    first = next(iter(found.values()))
    return {"rank": first.rank, "alpha": first.scaling * first.rank, "targets": tuple(found)}
