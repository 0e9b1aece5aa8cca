"""Low-rank adapters (LoRA) on the linear projections, in PEFT's layout.

`LoRALinear` keeps the frozen `base_layer` and adds `scaling * lora_B(lora_A(x))`,
where `lora_A: [rank, *in]` and `lora_B: [*out, rank]` are ordinary `Linear`s, so
their pytree paths are PEFT's names (`...q_proj.lora_A.weight`).

`LoRABank` holds `n` adapters of one rank stacked along a leading `adapters` axis and
applies to each row of the batch the adapter chosen for it (`select_adapters`), so
one batch trains or samples many adapters over one copy of the base weights. Each
row's adapter matrices are gathered from the bank (`[batch, rank, *in]`, a rank-sized
slice per sequence): the extra memory is the bank plus that gather, never a dense
per-adapter weight or a `[tokens, adapters, ...]` expansion.
"""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from ..core.ragged import RowGroups, join_tokens, split_rows, split_tokens
from ..core.sharding import HasAxes
from ..core.util import concrete_value
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


class AdapterSelection(HasAxes):
    """Which adapter of a `LoRABank` each row of the batch uses (set by `select_adapters`);
    `groups`: the rows are groups of rows laid out as one (`eqx_tx.core.ragged`), one
    id per row of all groups."""

    ids: Int[Array, " batch"]
    groups: RowGroups | None = eqx.field(static=True, default=None)

    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        return {"ids": ("batch",)}


class LoRABank(eqx.Module):
    """`base_layer(x) + scaling * B[i] @ A[i] @ x` for row `b` of `x`, `i = selection.ids[b]`.

    `lora_A.weight: [adapters, rank, *in]` and `lora_B.weight: [adapters, *out, rank]`;
    slot `i` is a PEFT adapter (see `adapter_slot`).
    """

    base_layer: Linear
    lora_A: Linear
    lora_B: Linear
    selection: AdapterSelection | None
    scaling: float = eqx.field(static=True)

    def __init__(self, base_layer: Linear, *, adapters: int, rank: int, alpha: float, dtype=jnp.float32,
                 key: PRNGKeyArray):
        """**Arguments:** as `LoRALinear`, and `adapters`, the number of slots; every
        slot starts as its own fresh PEFT-initialised adapter (`B = 0`)."""
        def slot(k):  # one PEFT-initialised adapter
            one = LoRALinear(base_layer, rank=rank, alpha=alpha, dtype=dtype, key=k)
            return one.lora_A.weight, one.lora_B.weight, one.lora_A.axes, one.lora_B.axes, one.scaling

        a, b, a_axes, b_axes, self.scaling = slot(key)
        a = jax.vmap(lambda k: slot(k)[0])(jax.random.split(key, adapters))
        self.base_layer = base_layer
        self.lora_A = _bank_linear(a, ("adapters", *a_axes), in_ndim=a.ndim - 2, key=key)
        self.lora_B = _bank_linear(jnp.zeros((adapters, *b.shape), dtype), ("adapters", *b_axes), in_ndim=1, key=key)
        self.selection = None

    @property
    def adapters(self) -> int:
        return self.lora_A.weight.shape[slot_axis(self.lora_A)]

    def __call__(self, x: Float[Array, "batch ..."]) -> Float[Array, "batch ..."]:
        y = self.base_layer(x)
        if self.selection is None:
            raise ValueError(f"this model holds a bank of {self.adapters} LoRA adapters: choose one per sequence "
                             "with eqx_tx.select_adapters(model, ids)")
        ids, groups = self.selection.ids, self.selection.groups
        if groups is None:
            d = self._delta(x, ids)
        else:
            d = join_tokens([self._delta(x_g, ids_g) for x_g, ids_g in zip(split_tokens(x, groups),
                                                                            split_rows(ids, groups))])
        return y + (self.scaling * d).reshape(y.shape).astype(y.dtype)

    def _delta(self, x: Float[Array, "batch seq ..."], ids: Int[Array, " batch"]) -> Float[Array, "batch seq out"]:
        """`B[i] @ A[i] @ x` for row `b` of `x`, `i = ids[b]` (unscaled, flattened outputs)."""
        B, r = x.shape[0], self.lora_A.weight.shape[1]
        a = self.lora_A.weight[ids].reshape(B, r, -1)  # [batch, rank, in]
        b = self.lora_B.weight[ids].reshape(B, -1, r)  # [batch, out, rank]
        x_bti = x.astype(a.dtype).reshape(B, -1, a.shape[-1])
        h_btr = jnp.einsum("bti,bri->btr", x_bti, a)
        return jnp.einsum("btr,bor->bto", h_btr, b)


def slot_axis(linear: Linear) -> int:
    """The `adapters` axis of a bank's `lora_A` or `lora_B`: after the stacked (layer) axes."""
    return linear.weight.ndim - len(linear.axes)


def _bank_linear(weight, axes: tuple[str | None, ...], *, in_ndim: int, key: PRNGKeyArray) -> Linear:
    """A `Linear` holding `weight` (`[adapters, *out, *in]`) with the given axes."""
    shape = weight.shape
    linear = Linear(shape[len(shape) - in_ndim :], shape[: len(shape) - in_ndim], axes=axes, dtype=weight.dtype,
                    init_std=0.0, key=key)
    return eqx.tree_at(lambda m: m.weight, linear, weight)


def _is_lora(x) -> bool:
    return isinstance(x, (LoRALinear, LoRABank))


def _is_bank(x) -> bool:
    return isinstance(x, LoRABank)


def _projections(
    model, names: tuple[str, ...], *, experts: bool = False
) -> list[tuple[tuple[str, ...], Linear | LoRALinear | LoRABank]]:
    """`(path, node)` of every projection (`Linear`, `LoRALinear`, `LoRABank`) in `model` whose
    attribute name is in `names`, found by module type wherever it sits, in the order
    of `names`. A named projection inside an MoE layer is an error (`experts=False`)
    or skipped (`experts=True`)."""
    found = []

    def visit(node, path: tuple[str, ...], in_moe: bool):
        if isinstance(node, (Linear, LoRALinear, LoRABank)):
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


@eqx.filter_jit
def _init_adapter(base: Linear, keys, rank: int, alpha: float, dtype, adapters: int | None, stacked: int):
    """A new adapter (or bank) for `base`, vmapped over its `stacked` leading axes,
    with `base_layer` left out (`None`: the caller puts the base back, uncopied).
    Compiled once per shape and setting (eager vmapped random ops take seconds)."""

    def make(base, k):
        if adapters is None:
            module = LoRALinear(base, rank=rank, alpha=alpha, dtype=dtype, key=k)
        else:
            module = LoRABank(base, adapters=adapters, rank=rank, alpha=alpha, dtype=dtype, key=k)
        return eqx.tree_at(lambda m: m.base_layer, module, None, is_leaf=lambda x: x is None)

    for _ in range(stacked):
        make = eqx.filter_vmap(make)
    return make(base, keys)


def apply_lora(model, *, rank: int, alpha: float, targets=ALL_TARGETS, dtype=jnp.float32, adapters: int | None = None,
               key: PRNGKeyArray):
    """Wrap the `targets` projections of every layer in `LoRALinear` adapters (or, with
    `adapters=n`, in `LoRABank`s of `n` adapters).

    **Arguments:**

    - `model`: a model without adapters (any module tree; projections are found by
      type and attribute name).
    - `rank`, `alpha`: adapter rank and scale.
    - `targets`: projection names (`q_proj`, ..., `down_proj`).
    - `dtype`: adapter dtype.
    - `adapters`: the number of adapters of a bank (`None`: one plain adapter). Each
      sequence then names its adapter (`select_adapters`, `Batch.adapter_ids`, the
      `adapters` argument of `generate`).
    - `key`: initialisation key.

    **Returns:** the model with adapters; see `lora_filter` to train only them.
    """
    if adapters is not None and (not isinstance(adapters, int) or adapters < 1):
        raise ValueError(f"adapters must be an int >= 1 (or None), got {adapters!r}")
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
        stacked_shape = node.weight.shape[: node.weight.ndim - len(node.axes)]  # e.g. (layers,)
        keys = jax.random.split(k, math.prod(stacked_shape)).reshape(stacked_shape) if stacked_shape else k
        adapter = _init_adapter(node, keys, rank, alpha, dtype, adapters, len(stacked_shape))
        wrapped.append(eqx.tree_at(lambda m: m.base_layer, adapter, node, is_leaf=lambda x: x is None))
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


def has_bank(model) -> bool:
    return any(_is_bank(n) for n in jax.tree.leaves(model, is_leaf=_is_lora))


def merge_lora(model):
    """Fold every adapter into its base weight; returns a plain model. (A bank has no
    single merge: merge one of its adapters, `merge_lora(adapter_slot(model, i))`.)"""
    if has_bank(model):
        raise ValueError("model holds a bank of LoRA adapters: merge one, merge_lora(adapter_slot(model, i))")
    return jax.tree.map(lambda n: n.merged() if _is_lora(n) else n, model, is_leaf=_is_lora)


def without_adapters(model):
    """`model` with every adapter (plain or bank) removed: the base projections only."""
    return jax.tree.map(lambda n: n.base_layer if _is_lora(n) else n, model, is_leaf=_is_lora)


def lora_settings(model) -> dict:
    """`rank`, `alpha`, `targets` of the adapters in `model`, and `adapters`, the size
    of its bank (`None` for a plain adapter)."""
    found = {path[-1]: node for path, node in _projections(model, ALL_TARGETS, experts=True) if _is_lora(node)}
    if not found:
        raise ValueError("model has no LoRA adapters")
    first = next(iter(found.values()))
    if isinstance(first, LoRABank):
        rank, bank = first.lora_A.weight.shape[slot_axis(first.lora_A) + 1], first.adapters
    else:
        assert isinstance(first, LoRALinear)
        rank, bank = first.rank, None
    return {"rank": rank, "alpha": first.scaling * rank, "targets": tuple(found), "adapters": bank}


def _banks(model) -> list[tuple[tuple[str, ...], LoRABank]]:
    return [(path, node) for path, node in _projections(model, ALL_TARGETS, experts=True) if isinstance(node, LoRABank)]


def select_adapters(model, ids: Int[ArrayLike, " batch"], *, groups: RowGroups | None = None):
    """Choose the adapter of each sequence: row `b` of the next batch uses adapter
    `ids[b]` of every `LoRABank` in `model`.

    **Arguments:**

    - `model`: a model with adapter banks (`apply_lora(..., adapters=n)`).
    - `ids`: `[batch]` adapter indices in `[0, n)` (out-of-range ids are clamped).
    - `groups`: the next call's tokens are these groups of rows laid out as one row
      (`eqx_tx.core.ragged`); `ids` has one entry per row of all groups.

    **Returns:** the model, ready to run on a batch of `len(ids)` rows.
    """
    banks = _banks(model)
    if not banks:
        raise ValueError("model has no LoRA adapter bank (apply_lora(..., adapters=n))")
    ids = jnp.asarray(ids, jnp.int32)
    selections = []
    for _, bank in banks:
        stacked = bank.lora_A.weight.shape[: slot_axis(bank.lora_A)]  # e.g. (layers,): scanned with the layer
        selections.append(AdapterSelection(jnp.broadcast_to(ids, (*stacked, *ids.shape)), groups))
    return eqx.tree_at(lambda m: [_get(m, p).selection for p, _ in banks], model, selections,
                       is_leaf=lambda x: x is None)


def check_adapter_ids(model, adapter_ids, batch: int, *, name: str = "adapter_ids") -> None:
    """Raise unless `adapter_ids` (called `name` in messages) names an adapter of
    `model`'s bank for each of the `batch` rows (values checked when concrete), or
    both are absent."""
    n = lora_settings(model)["adapters"] if has_bank(model) else None
    if n is None:
        if adapter_ids is not None:
            raise ValueError(f"{name} given, but the model has no LoRA adapter bank (apply_lora(..., adapters=n))")
        return
    if adapter_ids is None:
        raise ValueError(f"the model holds a bank of {n} LoRA adapters: {name} must name each sequence's adapter")
    if tuple(adapter_ids.shape) != (batch,):
        raise ValueError(f"{name} has shape {tuple(adapter_ids.shape)}, expected ({batch},): one per sequence")
    ids = concrete_value(adapter_ids)
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= n):
        raise ValueError(f"{name} must lie in [0, {n}) (the bank's adapters), got [{ids.min()}, {ids.max()}]")


def _bank_settings(model, slot: int) -> dict:
    """`lora_settings` of a model with a bank, raising unless `slot` is one of its adapters."""
    settings = lora_settings(model)
    n = settings["adapters"]
    if n is None:
        raise ValueError("model has no LoRA adapter bank")
    if not 0 <= slot < n:
        raise ValueError(f"adapter slot {slot} out of range: the bank holds {n}")
    return settings


def adapter_slot(model, slot: int):
    """Adapter `slot` of every bank in `model`, as a model with plain `LoRALinear`s
    (to save in PEFT's layout, merge, or run alone)."""
    settings = _bank_settings(model, slot)
    banks = _banks(model)
    single = apply_lora(without_adapters(model), rank=settings["rank"], alpha=settings["alpha"],
                        targets=settings["targets"], dtype=banks[0][1].lora_A.weight.dtype, key=jax.random.key(0))

    def take(linear: Linear):
        return jnp.take(linear.weight, slot, axis=slot_axis(linear))

    weights = [take(getattr(bank, ab)) for _, bank in banks for ab in ("lora_A", "lora_B")]
    return eqx.tree_at(lambda m: [getattr(_get(m, p), ab).weight for p, _ in banks for ab in ("lora_A", "lora_B")],
                       single, weights)


def set_adapter_slot(model, slot: int, adapter_model):
    """`model` with adapter `slot` of every bank replaced by the plain adapters of
    `adapter_model` (the same base, targets, rank and alpha)."""
    settings = _bank_settings(model, slot)
    other = lora_settings(adapter_model)
    mine = {k: settings[k] for k in ("rank", "alpha")} | {"targets": set(settings["targets"])}
    theirs = {k: other[k] for k in ("rank", "alpha")} | {"targets": set(other["targets"])}
    if other["adapters"] is not None or mine != theirs:
        raise ValueError(f"adapter {theirs} does not fit the bank's slots {mine}")
    banks = _banks(model)
    weights = []
    for path, bank in banks:
        single = _get(adapter_model, path)
        for ab in ("lora_A", "lora_B"):
            linear = getattr(bank, ab)
            index = (slice(None),) * slot_axis(linear) + (slot,)
            weights.append(linear.weight.at[index].set(getattr(single, ab).weight.astype(linear.weight.dtype)))
    return eqx.tree_at(lambda m: [getattr(_get(m, p), ab).weight for p, _ in banks for ab in ("lora_A", "lora_B")],
                       model, weights)
