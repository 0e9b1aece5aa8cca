"""One optimizer per adapter of a LoRA bank, in one update.

Training a bank (`apply_lora(..., adapters=n)`) must give each adapter what it would
get trained alone: its own gradient clipping, its own step count (warmup, bias
correction), its own moments, and no change at all in a step whose batch has none of
its rows. The optimizer is `jax.vmap`ped over the bank's `adapters` axis (each leaf's
axis where it sits, so the state is laid out, and sharded, like the weights), and
the adapters absent from a batch keep their weights and state.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Int

from ..layers.lora import LoRABank, slot_axis


def bank_axes(params):
    """The `adapters` axis of every bank weight in `params` (a trainable partition).

    Raises if `params` also holds arrays outside banks: a bank trains alone (one
    optimizer per adapter has no meaning for shared weights).
    """

    def visit(node):
        if isinstance(node, LoRABank):
            axes = jax.tree.map(lambda _: None, node)
            return eqx.tree_at(lambda m: (m.lora_A.weight, m.lora_B.weight), axes,
                               (slot_axis(node.lora_A), slot_axis(node.lora_B)), is_leaf=lambda x: x is None)
        if eqx.is_array(node) or isinstance(node, jax.ShapeDtypeStruct):
            raise ValueError(f"an array of shape {node.shape} trains beside a LoRA bank: train the bank alone "
                             "(the default trainable filter) or a plain model")
        return node

    return jax.tree.map(visit, params, is_leaf=lambda x: isinstance(x, LoRABank))


def _state_axes(optimizer: optax.GradientTransformation, params, axes):
    """The adapters axis of every optimizer-state leaf: the weight's for moments, 0 for counts."""
    one_slot = jax.eval_shape(lambda p: jax.tree.map(lambda x, a: jnp.take(x, 0, axis=a), p, axes), params)
    state = jax.eval_shape(optimizer.init, one_slot)
    return optax.tree_map_params(optimizer, lambda _, axis: axis, state, axes,
                                 transform_non_params=lambda _: 0, is_leaf=lambda x: x is None)


def init_bank_state(optimizer: optax.GradientTransformation, params) -> optax.OptState:
    """`optimizer.init` for each adapter of the banks in `params`."""
    axes = bank_axes(params)
    return jax.vmap(optimizer.init, in_axes=(axes,), out_axes=_state_axes(optimizer, params, axes))(params)


def update_bank(
    optimizer: optax.GradientTransformation, grads, opt_state: optax.OptState, params, present: Bool[Array, " adapters"]
):
    """One step of each adapter's own optimizer; adapters not `present` are left as they were.

    **Returns:** the new parameters and optimizer state.
    """
    axes = bank_axes(params)
    state_axes = _state_axes(optimizer, params, axes)
    step = jax.vmap(optimizer.update, in_axes=(axes, state_axes, axes), out_axes=(axes, state_axes))
    updates, new_state = step(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep(axis, new, old):
        shape = [1] * new.ndim
        shape[axis] = present.shape[0]
        return jnp.where(present.reshape(shape), new, old)

    new_params = jax.tree.map(keep, axes, new_params, params)
    new_state = jax.tree.map(keep, state_axes, new_state, opt_state)
    return new_params, new_state


def adapters_present(adapter_ids: Int[Array, " batch"], weights, adapters: int) -> Bool[Array, " adapters"]:
    """Which adapters have at least one weighted token in the batch."""
    rows = jnp.any(jnp.asarray(weights) != 0, axis=-1).astype(jnp.int32)
    return jax.ops.segment_sum(rows, jnp.asarray(adapter_ids), adapters) > 0
