"""Compile-time memory measurement of the real jitted functions, with no weights.

Every input is a `jax.ShapeDtypeStruct` carrying its real sharding, so
`jit(f).lower(...).compile().memory_analysis()` gives exact per-device figures
for any mesh: fake CPU devices, or compile-only GPU devices from a target
description (`target_mesh`), where bf16 buffers stay bf16 (XLA:CPU keeps f32
copies of bf16 buffers and overstates memory up to 2x).
"""

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .compute import ComputeConfig
from .generation import DecodeState, prefill, decode
from .layers.kv_cache import KVCache, SharedPrefixCache
from .layers.lora import ALL_TARGETS, ATTENTION_TARGETS, apply_lora, lora_filter
from .loading import abstract_model
from .models.config import TransformerConfig
from .sampling import SamplerArrays, SamplingParams
from .sharding import MESH_AXES, RULES, logical_to_spec, tree_shardings
from .training import Batch, TrainConfig, make_optimizer, train_step_jit

TARGETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "targets")
TARGET_FILES = {"a100-40gb": "a100_sxm_40.txtpb", "h100-80gb": "h100_sxm.txtpb"}


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """Per-device bytes from `compiled.memory_analysis()`."""

    argument: int
    output: int
    temp: int
    alias: int

    @property
    def total(self) -> int:
        """Peak live bytes: arguments + outputs + temporaries - donated (aliased) outputs."""
        return self.argument + self.output + self.temp - self.alias

    @classmethod
    def of(cls, compiled) -> "MemoryFigures":
        m = compiled.memory_analysis()
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, m.alias_size_in_bytes)


def target_mesh(
    target: str, *, dp: int = 1, ep: int = 1, sp: int = 1, tp: int = 8, targets_dir: str = TARGETS_DIR
) -> Mesh:
    """A `("dp", "ep", "sp", "tp")` mesh for `target`: `"cpu"` (the local, possibly fake,
    CPU devices) or a GPU name in `TARGET_FILES` (compile-only devices; needs
    `jax-cuda13-plugin` and `JAX_PLATFORMS=cpu`, no GPU)."""
    n = dp * ep * sp * tp
    if target == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise ValueError(
                f"target cpu needs {n} devices, found {len(devices)}: set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts"
            )
        devices = devices[:n]
    elif target in TARGET_FILES:
        import jax.experimental.topologies as topologies

        with open(os.path.join(targets_dir, TARGET_FILES[target])) as f:
            spec = f.read()
        try:
            topo = topologies.get_topology_desc(
                platform="cuda", topology_name="", topology=f"1x1x{n}", target_config=spec
            )
        except Exception as e:  # noqa: BLE001 - the plugin's errors are not typed
            raise RuntimeError(
                f"cannot create compile-only devices for {target}: {e}. Install the bench extra "
                "(pip install -e '.[bench]': jax-cuda13-plugin/pjrt at the jax version, nvidia-cudnn-cu13)"
            ) from None
        devices = topo.devices
    else:
        raise ValueError(f"unknown target {target!r}; choose cpu or {', '.join(TARGET_FILES)}")
    grid = np.asarray(devices, dtype=object).reshape(dp, ep, sp, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _is_array_like(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _with_shardings(tree, mesh):
    shardings = tree_shardings(tree, mesh, RULES)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _sds(shape, dtype, mesh, *names):
    spec = logical_to_spec(names + (None,) * (len(shape) - len(names)), shape, mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_sharded_model(config: TransformerConfig, mesh, dtype=jnp.bfloat16, *, lora_rank: int = 0):
    """The model as sharded `ShapeDtypeStruct`s; with `lora_rank`, LoRA adapters on every
    projection (on the attention projections only for MoE models)."""
    model = abstract_model(config, dtype)
    if lora_rank:
        targets = ATTENTION_TARGETS if config.num_experts else ALL_TARGETS
        model = eqx.filter_eval_shape(
            lambda m: apply_lora(m, rank=lora_rank, alpha=2.0 * lora_rank, targets=targets, key=jax.random.key(0)),
            model,
        )
    return _with_shardings(model, mesh)


def compile_train_step(model, mesh, batch: int, seq_len: int, config: TrainConfig):
    """Lower and compile `train_step_jit` for abstract, sharded inputs; returns the compiled step."""
    spec = lora_filter(model)
    params, frozen = eqx.partition(model, spec if any(jax.tree.leaves(spec)) else _is_array_like)
    if not jax.tree.leaves(params):
        raise ValueError("nothing to train: the model has no arrays")
    opt_state = jax.eval_shape(make_optimizer(config.optimizer, params).init, params)
    # Optimizer moments follow their parameter's sharding; scalars are replicated.
    param_sharding = {x.shape: x.sharding for x in jax.tree.leaves(params)}
    opt_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=param_sharding.get(x.shape, NamedSharding(mesh, P()))
        ),
        opt_state,
    )
    b = Batch(
        _sds((batch, seq_len), jnp.int32, mesh, "batch"),
        _sds((batch, seq_len), jnp.int32, mesh, "batch"),
        _sds((batch, seq_len), jnp.float32, mesh, "batch"),
        _sds((batch,), jnp.int32, mesh, "batch"),
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        return train_step_jit.lower(params, opt_state, step, frozen, b, config).compile()


def abstract_cache(config: TransformerConfig, mesh, batch: int, max_len: int, dtype) -> KVCache:
    """A sharded abstract `KVCache` (`dtype` int8: with its float32 scales)."""
    cache = jax.eval_shape(lambda: KVCache.zeros(
        layers=config.num_hidden_layers, batch=batch, max_len=max_len, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, dtype=dtype,
    ))
    return _with_shardings(cache, mesh)


def compile_sampling(
    model,
    mesh,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    compute: ComputeConfig,
    cache_dtype=jnp.bfloat16,
    prefill_chunk: int | None = None,
    full_logits: bool = False,
    n: int = 1,
):
    """Compile the real `prefill` and `decode` for `batch` sequences: prompts of
    `prompt_len` tokens, `new_tokens` new tokens each. With `n > 1` the `batch`
    sequences are `n` samples of `batch / n` prompts sharing each prompt's cache.
    Returns `{"prefill": compiled, "decode": compiled}`."""
    config = model.config
    V = config.vocab_size
    if batch % n:
        raise ValueError(f"batch {batch} is not a multiple of n={n}")
    prompts = batch // n
    chunk = prefill_chunk or prompt_len
    tokens = _sds((prompts, -(-prompt_len // chunk) * chunk), jnp.int32, mesh, "batch")
    prompt_lengths = _sds((prompts,), jnp.int32, mesh, "batch")
    if n == 1:
        cache = decode_cache = abstract_cache(config, mesh, batch, prompt_len + new_tokens, cache_dtype)
    else:
        cache = abstract_cache(config, mesh, prompts, prompt_len, cache_dtype)
        completion = abstract_cache(config, mesh, batch, new_tokens, cache_dtype)
        decode_cache = SharedPrefixCache(cache, completion, prompt_lengths)
    lengths = _sds((batch,), jnp.int32, mesh, "batch")
    state = DecodeState(
        cache=decode_cache,
        logits=_sds((batch, V), jnp.float32, mesh, "batch", "act_vocab"),
        lengths=lengths,
        generated=lengths,
        done=lengths,
        tokens=_sds((batch, new_tokens), jnp.int32, mesh, "batch"),
        logprobs=_sds((batch, new_tokens), jnp.float32, mesh, "batch"),
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    )
    sampler = jax.eval_shape(lambda: SamplerArrays.from_params([SamplingParams()] * batch, (0,), V))
    sampler = jax.tree.map(lambda x: _sds(x.shape, x.dtype, mesh, "batch"), sampler)
    with jax.set_mesh(mesh):
        pre = prefill.lower(model, cache, tokens, prompt_lengths, chunk=chunk, compute=compute, full_logits=full_logits)
        dec = decode.lower(model, state, sampler, jax.ShapeDtypeStruct((), jnp.int32), compute=compute)
        return {"prefill": pre.compile(), "decode": dec.compile()}
