"""Training checkpoints: trainable parameters, optimizer state, step, data position.

A checkpoint is a directory with `state.safetensors` (one tensor per leaf, keyed by
its pytree path) and `metadata.json`, written atomically (a crash mid-save leaves
the previous checkpoint intact). The frozen part of the model (the base weights of
a LoRA run) is not saved: it is reloaded from its own checkpoint.
"""

import json
import os

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .fileio import atomic_directory
from .training import TrainState

STATE_FILE = "state.safetensors"
METADATA_FILE = "metadata.json"


def _saved_part(state: TrainState):
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def _flat(tree) -> list[tuple[str, object]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def save_checkpoint(directory: str | os.PathLike, state: TrainState, *, metadata: dict) -> None:
    """Write `state` (minus the frozen weights) and `metadata` (JSON) atomically."""
    tensors = {key: np.asarray(jax.device_get(leaf)) for key, leaf in _flat(_saved_part(state))}
    meta = dict(metadata, step=int(state.step))
    with atomic_directory(directory) as tmp:
        save_file(tensors, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=2)


def read_metadata(directory: str | os.PathLike) -> dict:
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, STATE_FILE)):
        raise FileNotFoundError(f"{directory} is not a complete eqx_tx checkpoint (no {METADATA_FILE} / {STATE_FILE})")
    with open(path) as f:
        return json.load(f)


def restore_checkpoint(directory: str | os.PathLike, template: TrainState) -> tuple[TrainState, dict]:
    """Fill `template` (same structure, any values) from `directory`.

    Each array is placed with the sharding of the template's leaf, every device
    reading only its own slice.
    """
    meta = read_metadata(directory)
    path = os.path.join(directory, STATE_FILE)
    part = _saved_part(template)
    flat = _flat(part)
    with safe_open(path, framework="flax") as f:
        stored = set(f.keys())
        expected = {k for k, _ in flat}
        if stored != expected:
            raise KeyError(
                f"{path} does not match this training setup: missing {sorted(expected - stored)[:5]}, "
                f"unexpected {sorted(stored - expected)[:5]}"
            )
        arrays = []
        for key, leaf in flat:
            sl = f.get_slice(key)
            if tuple(sl.get_shape()) != tuple(leaf.shape):
                raise ValueError(f"{path}: {key} has shape {tuple(sl.get_shape())}, expected {tuple(leaf.shape)}")

            def read(index, sl=sl, leaf=leaf):
                return np.asarray(sl[index] if leaf.ndim else sl[...]).astype(leaf.dtype)

            arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
    restored = jax.tree.unflatten(jax.tree.structure(part), arrays)
    state = TrainState(params=restored["params"], frozen=template.frozen, opt_state=restored["opt_state"],
                       step=restored["step"])
    return state, meta
