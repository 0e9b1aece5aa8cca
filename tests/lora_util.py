"""LoRA adapters for tests that differ from their initialisation (which, with B = 0,
makes every adapter the base model itself)."""

import equinox as eqx
import jax

from eqx_tx.layers.lora import lora_filter


@jax.jit
def _perturb(adapters, key):
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def perturbed_adapters(model, key):
    """`model` with `0.05 * N(0, 1)` noise (drawn from `key`) added to every LoRA weight
    (A and B, each slot of a bank); the base weights are untouched, not copied."""
    adapters, rest = eqx.partition(model, lora_filter(model))
    return eqx.combine(_perturb(adapters, key), rest)
