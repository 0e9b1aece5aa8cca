"""Save models as Hugging Face checkpoints (safetensors + config.json), atomically."""

import contextlib
import json
import math
import os
import shutil
from collections.abc import Mapping

import jax
import numpy as np
from safetensors.numpy import save_file

from ..core.distributed import to_host
from ..core.fileio import atomic_directory, barrier
from ..layers.lora import has_lora
from ..models import CausalLM
from .hf_params import hf_tensors

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def tokenizer_files(directory: str | os.PathLike | None) -> dict[str, str]:
    """The tokenizer and generation files of a checkpoint directory, for `extra_files`."""
    if directory is None:
        return {}
    paths = {name: os.path.join(directory, name) for name in TOKENIZER_FILES}
    return {name: path for name, path in paths.items() if os.path.isfile(path)}


def _dtype_name(dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[np.dtype(dtype).name]


def save(
    model: CausalLM,
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, str | os.PathLike] | None = None,
) -> None:
    """Write `model` as a Hugging Face checkpoint directory.

    Tensors are written per layer (never the whole model on the host at once) into
    `model.safetensors`, or into `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` above `max_shard_bytes`. The directory is
    replaced atomically: a crash mid-save leaves the previous checkpoint intact.

    **Arguments:**

    - `model`: the model (its arrays may be sharded on any mesh).
    - `directory`: where to write; replaced if it exists.
    - `max_shard_bytes`: the size above which tensors go to several files.
    - `extra_files`: files to copy in, `{name in the checkpoint: source path}`
      (e.g. the tokenizer, see `tokenizer_files`).
    """
    if has_lora(model):
        raise ValueError("model has LoRA adapters: save them with eqx_tx.save_adapter, or merge_lora(model) first")
    specs = list(hf_tensors(model))
    entries = []  # (hf name, spec, stacked index, bytes)
    for spec in specs:
        arr = spec.get(model)
        nbytes = math.prod(spec.layer_shape) * np.dtype(arr.dtype).itemsize
        for idx in spec.indices():
            entries.append((spec.name.format(*idx), spec, idx, nbytes))

    shards, current, size = [], [], 0
    for entry in entries:
        if current and size + entry[3] > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry[3]
    shards.append(current)

    hf_config = model.config.to_hf()
    hf_config["dtype"] = _dtype_name(model.dtype)

    main = jax.process_index() == 0  # multi-host: every process gathers, process 0 writes
    with atomic_directory(directory) if main else contextlib.nullcontext() as tmp:
        weight_map = {}
        for n, shard in enumerate(shards):
            filename = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, spec, idx, _ in shard:
                part = spec.get(model)[idx]  # one tensor at a time, never the whole model on the host
                tensors[name] = np.ascontiguousarray(spec.to_hf(to_host(part)))
                weight_map[name] = filename
            if tmp is not None:  # the main process
                save_file(tensors, os.path.join(tmp, filename), metadata={"format": "pt"})
        if tmp is not None:
            if len(shards) > 1:
                total = sum(e[3] for e in entries)
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf_config, f, indent=2)
            for name, src in (extra_files or {}).items():
                shutil.copy(src, os.path.join(tmp, name))
    barrier("eqx_tx-save")
