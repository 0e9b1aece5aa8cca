"""Training checkpoints: trainable parameters, optimizer state, step, data position.

Layout (`root` is e.g. `runs/tiny/checkpoint`):

    root/step_00000005/shards-00000.safetensors   # the shards process 0 holds
    root/step_00000005/shards-00001.safetensors   # ... process 1 (multi-host)
    root/step_00000005/metadata.json              # step, data position, run settings
    root/step_00000005/COMMITTED                  # written last, by process 0

Every process writes the shards it holds (one replica of each, never gathering the
model on one host); after a barrier, process 0 writes `metadata.json` and then the
`COMMITTED` marker, and only then deletes older checkpoints. A step directory
without the marker is an interrupted save: it is never resumed from, and opening
it directly is an error saying so. Restoring reads, on every device, only the parts
of the stored shards that overlap the slice that device holds, so a checkpoint
saved with one number of processes (or mesh) resumes with another.

The frozen part of the model (the base weights of a LoRA run) is not saved: it is
reloaded from its own checkpoint.
"""

import json
import os
import re
import shutil

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ..core.distributed import host_device, to_host
from ..core.fileio import barrier, fsync_dir, fsync_file, usual_modes, write_text_durably
from .training import TrainState

METADATA_FILE = "metadata.json"
COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_KEEP = 2  # committed checkpoints kept


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory whose save did not finish (no commit marker)."""


def _saved_part(state: TrainState):
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def _flat(tree) -> list[tuple[str, jax.Array]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def _box_key(name: str, index: tuple, shape: tuple) -> str:
    box = ",".join(f"{s.start or 0}:{s.stop if s.stop is not None else n}" for s, n in zip(index, shape))
    return f"{name}|{box}"


def _parse_box_key(key: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    name, box = key.rsplit("|", 1)
    bounds = [part.split(":") for part in box.split(",") if part]
    return name, tuple((int(a), int(b)) for a, b in bounds)


def _after_shards_written(step: int) -> None:
    """Runs on each process once its shards of `step` are on disk, before the commit.
    A no-op: the tests of interrupted saves replace it to kill a process there."""


def save_checkpoint(root: str | os.PathLike, state: TrainState, *, metadata: dict) -> str:
    """Write `state` (minus the frozen weights) and `metadata` as `root/step_<step>`.

    Every process must call this (it contains barriers). **Returns** the step directory.
    """
    step = int(to_host(state.step))
    directory = os.path.join(os.fspath(root), f"step_{step:08d}")
    if jax.process_index() == 0:
        if os.path.exists(directory):  # an interrupted earlier attempt at this step
            shutil.rmtree(directory)
        os.makedirs(directory)
    barrier(f"checkpoint-{step}-open")
    flat = _flat(_saved_part(state))
    tensors = {}
    for name, leaf in flat:
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                tensors[_box_key(name, shard.index, leaf.shape)] = np.asarray(shard.data)
    path = os.path.join(directory, f"shards-{jax.process_index():05d}.safetensors")
    save_file(tensors, path)
    usual_modes(path)  # (safetensors writes 0600)
    fsync_file(path)
    _after_shards_written(step)
    barrier(f"checkpoint-{step}-written")
    if jax.process_index() == 0:
        meta: dict = dict(metadata, step=step, processes=jax.process_count())
        meta["leaves"] = {name: [list(leaf.shape), str(leaf.dtype)] for name, leaf in flat}
        write_text_durably(os.path.join(directory, METADATA_FILE), json.dumps(meta, indent=2))
        write_text_durably(os.path.join(directory, COMMIT_MARKER), f"{step}\n")
        fsync_dir(directory)
        for old in _step_dirs(root)[:-_KEEP]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    barrier(f"checkpoint-{step}-committed")
    return directory


def _step_dirs(root) -> list[str]:
    """Committed step directories under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n))
    return [n for n in names if os.path.isfile(os.path.join(root, n, COMMIT_MARKER))]


def has_checkpoint(root: str | os.PathLike) -> bool:
    """Whether `root` holds a committed checkpoint (`--resume` of a run that saved none
    yet starts from the beginning)."""
    return bool(_step_dirs(root))


def latest_checkpoint(root: str | os.PathLike) -> str:
    """The newest committed step directory under `root` (or `root` itself if it is one)."""
    root = os.fspath(root)
    if _STEP_DIR.match(os.path.basename(os.path.normpath(root))):
        if not os.path.isfile(os.path.join(root, COMMIT_MARKER)):
            raise IncompleteCheckpointError(
                f"{root} is an incomplete checkpoint: no {COMMIT_MARKER} marker (its save was interrupted)"
            )
        return root
    committed = _step_dirs(root)
    if not committed:
        raise FileNotFoundError(f"no committed checkpoint in {root}")
    return os.path.join(root, committed[-1])


def read_metadata(path: str | os.PathLike) -> dict:
    """Metadata of the newest committed checkpoint under `path` (or of that step directory)."""
    with open(os.path.join(latest_checkpoint(path), METADATA_FILE)) as f:
        return json.load(f)


def restore_checkpoint(path: str | os.PathLike, template: TrainState) -> tuple[TrainState, dict]:
    """Fill `template` (same structure, any values and shardings) from the newest
    committed checkpoint under `path`; each device reads only what it holds."""
    directory = latest_checkpoint(path)
    with open(os.path.join(directory, METADATA_FILE)) as f:
        meta = json.load(f)
    files = sorted(n for n in os.listdir(directory) if n.startswith("shards-") and n.endswith(".safetensors"))
    handles = {n: safe_open(os.path.join(directory, n), framework="flax") for n in files}
    pieces: dict[str, list] = {}
    for handle in handles.values():
        for key in handle.keys():
            name, box = _parse_box_key(key)
            pieces.setdefault(name, []).append((handle, key, box))
    part = _saved_part(template)
    flat = _flat(part)
    expected = {name for name, _ in flat}
    if set(meta["leaves"]) != expected:
        missing, extra = sorted(expected - set(meta["leaves"])), sorted(set(meta["leaves"]) - expected)
        raise KeyError(f"{directory} does not match this training setup: missing {missing[:5]}, unexpected {extra[:5]}")
    host = host_device()
    arrays = []
    for name, leaf in flat:
        shape, _ = meta["leaves"][name]
        if tuple(shape) != tuple(leaf.shape):
            raise ValueError(f"{directory}: {name} has shape {tuple(shape)}, expected {tuple(leaf.shape)}")

        def read(index, name=name, leaf=leaf):
            target = [s.indices(n)[:2] for s, n in zip(index, leaf.shape)]
            out = np.zeros([b - a for a, b in target], dtype=leaf.dtype)
            for handle, key, box in pieces.get(name, []):
                lo = [max(a, c) for (a, _), (c, _) in zip(target, box)]
                hi = [min(b, d) for (_, b), (_, d) in zip(target, box)]
                if any(l >= h for l, h in zip(lo, hi)):
                    continue
                src = tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, box))
                dst = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, target))
                with jax.default_device(host):  # numpy cannot hold bf16 slices; read via the CPU device
                    out[dst] = np.asarray(handle.get_slice(key)[src] if src else handle.get_tensor(key))
            return out

        arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
    restored = jax.tree.unflatten(jax.tree.structure(part), arrays)
    state = TrainState(params=restored["params"], frozen=template.frozen, opt_state=restored["opt_state"],
                       step=restored["step"])
    return state, meta
