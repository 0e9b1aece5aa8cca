"""Load Hugging Face safetensors checkpoints into (sharded) Equinox models.

Each device reads only its own slice of each tensor (`safe_open(...).get_slice`
inside `jax.make_array_from_callback`), and the stacked `[layers, ...]` arrays are
assembled per device from per-layer slices, so the whole checkpoint is never in
host memory at once. Pickled weights (`*.bin`, `*.pt`, ...) are refused, never
opened.
"""

import glob
import json
import os
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from ..core.distributed import host_device
from ..core.fileio import open_safetensors
from ..core.sharding import RULES, MeshAxes, tree_shardings
from ..models import CausalLM, config_from_hf
from ..models.config import read_hf_config
from .hf_params import hf_tensors

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Buffers some exporters write that carry no parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_source(source: str | os.PathLike) -> str:
    """A local directory for `source`: itself if it is one, else a hub download.

    Hub repos are fetched with `huggingface_hub.snapshot_download`, safetensors,
    JSON and tokenizer files only (never pickles).
    """
    source = os.fspath(source)
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        raise NotADirectoryError(f"{source} is a file; pass the checkpoint directory")
    looks_local = source.startswith((".", "/", "~")) or source.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"checkpoint directory {source} does not exist (and it is not a hub repo id)")
    from huggingface_hub import snapshot_download

    return snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt"])


def checkpoint_files(directory: str) -> dict[str, str]:
    """Map every tensor name to the safetensors file holding it."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no 'weight_map'")
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(directory, v))})
        if missing:
            raise FileNotFoundError(f"{index_path} names shard files that do not exist: {missing}")
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    others = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if others:
        files = {}
        for path in others:
            with open_safetensors(path) as f:
                files.update({k: path for k in f.keys()})
        return files
    pickles = sorted(p for p in os.listdir(directory) if p.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{directory} has only pickled weights ({', '.join(pickles)}); eqx_tx never unpickles "
            "checkpoints. Convert them to safetensors first."
        )
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")


def _checkpoint_dtype(hf: dict):
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name), jnp.float32)


def abstract_model(config, dtype) -> CausalLM:
    """The model's structure, shapes and dtypes, without allocating anything."""
    return eqx.filter_eval_shape(CausalLM, config, dtype=dtype, key=jax.random.key(0))


def load(
    source: str | os.PathLike,
    *,
    dtype=None,
    mesh: Mesh | None = None,
    rules: Mapping[str, MeshAxes] = RULES,
    progress: bool = True,
) -> CausalLM:
    """Load a Hugging Face checkpoint.

    **Arguments:**

    - `source`: a local directory or a hub repo id.
    - `dtype`: parameter dtype (default: the checkpoint's `dtype`/`torch_dtype`).
    - `mesh`: shard the parameters on this mesh by `rules` (default: one device).
    - `rules`: logical-axis sharding rules.
    - `progress`: show a progress bar.

    **Returns:** a `CausalLM` whose arrays are placed (and sharded) on the devices.
    """
    directory = resolve_source(source)
    hf = read_hf_config(directory)
    config = config_from_hf(hf)
    dtype = _checkpoint_dtype(hf) if dtype is None else dtype
    abstract = abstract_model(config, dtype)
    specs = list(hf_tensors(abstract))
    files = checkpoint_files(directory)

    expected = {name for s in specs for name in s.hf_names()}
    present = set(files)
    ignorable = {k for k in present if k.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and "lm_head.weight" in present:
        ignorable.add("lm_head.weight")  # some exporters write the tied copy too
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - ignorable)
    if missing:
        raise KeyError(f"{directory}: checkpoint is missing {len(missing)} tensor(s): {_short(missing)}")
    if unexpected:
        raise KeyError(f"{directory}: checkpoint has {len(unexpected)} unexpected tensor(s): {_short(unexpected)}")

    if mesh is None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), abstract)
    else:
        shardings = tree_shardings(abstract, mesh, rules)
    arrays = read_arrays(specs, files, shardings, dtype, where=directory, progress=progress)
    return eqx.tree_at(lambda m: [s.get(m) for s in specs], abstract, [arrays[s.path] for s in specs])


def read_arrays(specs, files: dict[str, str], shardings, dtype, *, where: str, prefix: str = "", progress=False):
    """Read each `HFTensor` of `specs` into a device array laid out by `shardings`.

    Shapes are checked against the files first; then every device reads only the
    slice it holds. `files` maps (prefixed) tensor names to safetensors paths.
    """
    handles = {path: open_safetensors(path) for path in sorted(set(files.values()))}
    for spec in specs:
        for name in spec.hf_names():
            found = tuple(handles[files[prefix + name]].get_slice(prefix + name).get_shape())
            if found != spec.hf_shape:
                raise ValueError(
                    f"{where}: tensor {prefix + name} has shape {found}, expected {spec.hf_shape} "
                    f"(from config.json)"
                )
    host = host_device()

    def get_hf_slice(name, hf_index):
        with jax.default_device(host):
            return np.asarray(handles[files[prefix + name]].get_slice(prefix + name)[hf_index])

    arrays = {}
    for spec in tqdm(specs, desc="loading", disable=not progress, leave=False):
        cache: dict = {}

        def callback(index, spec=spec, cache=cache):
            key = tuple(_normalise(s, n) for s, n in zip(index, spec.shape))
            if key not in cache:
                cache[key] = spec.read(get_hf_slice, tuple(slice(*k) for k in key)).astype(dtype)
            return cache[key]

        arrays[spec.path] = jax.make_array_from_callback(spec.shape, spec.get(shardings), callback)
    handles.clear()
    return arrays


def _normalise(s: slice, n: int) -> tuple[int, int, int]:
    return s.indices(n)


def _short(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
