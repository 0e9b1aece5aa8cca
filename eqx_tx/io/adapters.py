"""LoRA adapters on disk in PEFT's layout (`adapter_model.safetensors`, `adapter_config.json`)."""

import json
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import save_file

from ..core.distributed import to_host
from ..core.fileio import atomic_directory, barrier, open_safetensors
from ..core.sharding import RULES, mesh_of, tree_shardings
from ..layers.lora import adapter_slot, apply_lora, has_bank, lora_settings, set_adapter_slot, without_adapters
from .hf_params import hf_tensors
from .loading import read_arrays

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _adapter_specs(model):
    return [s for s in hf_tensors(model) if ".lora_A." in s.name or ".lora_B." in s.name]


def save_adapter(model, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                 slot: int | None = None) -> None:
    """Write `model`'s LoRA adapters as a PEFT adapter directory, atomically.

    Loadable with `peft.PeftModel.from_pretrained(base, directory)`. For a model with
    an adapter bank, `slot` says which adapter to write.
    """
    if has_bank(model):
        if slot is None:
            raise ValueError(f"the model holds a bank of {lora_settings(model)['adapters']} adapters: "
                             "pass slot= to say which one to save")
        model = adapter_slot(model, slot)
    elif slot is not None:
        raise ValueError("slot= given, but the model has no adapter bank")
    settings = lora_settings(model)
    tensors = {}
    for spec in _adapter_specs(model):
        for name, value in spec.items(to_host(spec.get(model))):
            tensors[PEFT_PREFIX + name] = np.ascontiguousarray(value)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings["rank"],
        "lora_alpha": settings["alpha"],
        "target_modules": sorted(settings["targets"]),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    if jax.process_index() == 0:  # multi-host: every process gathered, process 0 writes
        with atomic_directory(directory) as tmp:
            save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
                json.dump(config, f, indent=2)
    barrier("eqx_tx-save-adapter")


def _read_config(directory: str | os.PathLike) -> dict:
    """`rank`, `alpha` and `targets` of the PEFT LoRA adapter in `directory`."""
    config_path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{os.fspath(directory)} is not a PEFT adapter: {ADAPTER_CONFIG} missing")
    with open(config_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("fan_in_fan_out"):
        raise ValueError(f"{config_path}: DoRA, rsLoRA and fan_in_fan_out adapters are not supported")
    targets = cfg["target_modules"]
    return dict(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                targets=sorted([targets] if isinstance(targets, str) else targets))


def load_adapter_bank(model, directories: Sequence[str | os.PathLike], *, dtype=jnp.float32,
                      base_slot: bool = False):
    """A bank of the PEFT LoRA adapters in `directories` on `model` (without adapters).

    **Arguments:**

    - `model`: the base model.
    - `directories`: PEFT adapter directories of the same targets, rank and alpha;
      directory `i` goes to slot `i`.
    - `dtype`: the adapters' dtype.
    - `base_slot`: add slot 0 of zeros (`B = 0`: exactly the base model), and put
      directory `i` in slot `i + 1`, so one bank serves the base and its adapters.

    **Returns:** the model with a bank of `len(directories) + base_slot` adapters.
    """
    if not directories:
        raise ValueError("load_adapter_bank needs at least one adapter directory")
    settings = _read_config(directories[0])
    bank = apply_lora(model, **settings, dtype=dtype, adapters=len(directories) + base_slot, key=jax.random.key(0))
    for i, directory in enumerate(directories):
        if (other := _read_config(directory)) != settings:
            raise ValueError(f"{os.fspath(directory)}: adapter {other} differs from {os.fspath(directories[0])}'s "
                             f"{settings}: one bank needs the same targets, rank and alpha")
        bank = load_adapter(bank, directory, dtype=dtype, slot=i + base_slot)
    return bank


def load_adapter(model, directory: str | os.PathLike, *, dtype=jnp.float32, slot: int | None = None):
    """Attach the PEFT LoRA adapter in `directory` to `model` (sharded like the model).

    With `slot`, `model` holds an adapter bank (`apply_lora(..., adapters=n)`) and the
    adapter is written into its slot `slot` (same targets, rank and alpha as the bank).
    """
    if slot is not None:
        if not has_bank(model):
            raise ValueError("slot= given, but the model has no adapter bank")
        return set_adapter_slot(model, slot, load_adapter(without_adapters(model), directory, dtype=dtype))
    directory = os.fspath(directory)
    weights_path = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"{directory} is not a PEFT adapter: {ADAPTER_WEIGHTS} missing")
    with_lora = apply_lora(model, **_read_config(directory), dtype=dtype, key=jax.random.key(0))
    specs = _adapter_specs(with_lora)
    with open_safetensors(weights_path) as f:
        names = set(f.keys())
    expected = {PEFT_PREFIX + n for s in specs for n in s.hf_names()}
    if names != expected:
        missing, extra = sorted(expected - names), sorted(names - expected)
        raise KeyError(f"{weights_path}: missing {missing[:5]}, unexpected {extra[:5]}")
    mesh = mesh_of(model)
    if mesh is None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), with_lora)
    else:
        shardings = tree_shardings(eqx.filter(with_lora, eqx.is_array), mesh, RULES)
    arrays = read_arrays(specs, {n: weights_path for n in names}, shardings, dtype, where=directory, prefix=PEFT_PREFIX)
    return eqx.tree_at(lambda m: [s.get(m) for s in specs], with_lora, [arrays[s.path] for s in specs])
