"""Compile-time memory measurement of the real jitted functions, with no weights.

Every input is a `jax.ShapeDtypeStruct` carrying its real sharding, so
`jit(f).lower(...).compile().memory_analysis()` gives exact per-device figures
for any mesh: fake CPU devices, or compile-only GPU devices from a target
description (`target_mesh`), where bf16 buffers stay bf16 (XLA:CPU keeps f32
copies of bf16 buffers and overstates memory up to 2x).
"""

import functools
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..cache.allocate import new_cache, new_paged_cache
from ..cache.shared_prefix import SharedPrefixCache
from ..core.compute import ComputeConfig
from ..core.memory_figures import MemoryFigures
from ..core.sharding import abstract_with_shardings, logical_to_spec, make_mesh
from ..core.util import ceil_div, round_up
from ..infer.config import EngineConfig
from ..infer.generation import DecodeState, decode, prefill
from ..infer.sampling import SamplerArrays, SamplingParams
from ..infer.steps import paged_decode_step, paged_mixed_step, paged_prefill_chunk
from ..io.loading import abstract_model
from ..layers.lora import ALL_TARGETS, ATTENTION_TARGETS, apply_lora, has_bank, trainable_filter
from ..models.config import TransformerConfig
from ..train.bank_optimizer import init_bank_state
from ..train.batch import Batch
from ..train.training import TrainConfig, make_optimizer, resolve_remat, train_step_jit

# Compile-only GPU descriptions shipped with the package (`target_mesh`).
TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
TARGET_FILES = {"a100-40gb": "a100_sxm_40.txtpb", "h100-80gb": "h100_sxm.txtpb"}


def target_mesh(
    target: str, *, dp: int = 1, ep: int = 1, sp: int = 1, tp: int = 8, targets_dir: str = TARGETS_DIR
) -> Mesh:
    """The `make_mesh` mesh over the devices of `target`: `"cpu"` (the local, possibly
    fake, CPU devices) or a GPU name in `TARGET_FILES` (compile-only devices described
    by the files in `targets_dir`; needs `jax-cuda13-plugin` and `JAX_PLATFORMS=cpu`,
    no GPU)."""
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
    return make_mesh(dp=dp, ep=ep, sp=sp, tp=tp, devices=devices)


def _sds(shape, dtype, mesh, *names) -> Any:
    """A sharded `ShapeDtypeStruct`, standing in for an array in the abstract inputs."""
    spec = logical_to_spec(names + (None,) * (len(shape) - len(names)), shape, mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_sharded_model(config: TransformerConfig, mesh, dtype=jnp.bfloat16, *, lora_rank: int = 0,
                           lora_adapters: int | None = None):
    """The model as sharded `ShapeDtypeStruct`s; with `lora_rank`, LoRA adapters on every
    projection (on the attention projections only for MoE models), a bank of
    `lora_adapters` of them if given."""
    model = abstract_model(config, dtype)
    if lora_rank:
        targets = ATTENTION_TARGETS if config.num_experts else ALL_TARGETS
        model = eqx.filter_eval_shape(
            lambda m: apply_lora(m, rank=lora_rank, alpha=2.0 * lora_rank, targets=targets, adapters=lora_adapters,
                                 key=jax.random.key(0)),
            model,
        )
    return abstract_with_shardings(model, mesh)


def abstract_train_state(model, mesh, config: TrainConfig):
    """The trainable part, optimizer state and frozen part of abstract sharded `model`,
    as `init_train_state` splits them, with the shardings `train_step` receives.

    Each optimizer moment takes the sharding of the parameter it belongs to (in
    pinned host memory with `config.offload_optimizer`; matched
    by position in the tree with `optax.tree_map_params`, never by shape: two weights
    of one shape may be sharded differently); the other state (step counts) is
    replicated.
    """
    params, frozen = eqx.partition(model, trainable_filter(model))
    if not jax.tree.leaves(params):
        raise ValueError("nothing to train: the model has no arrays")
    optimizer = make_optimizer(config.optimizer, params)
    init = functools.partial(init_bank_state, optimizer) if has_bank(params) else optimizer.init
    shapes = jax.eval_shape(init, params)
    replicated = NamedSharding(mesh, P())
    kind = "pinned_host" if config.offload_optimizer else "device"
    opt_state = optax.tree_map_params(
        optimizer,
        lambda x, p: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=p.sharding.with_memory_kind(kind)),
        shapes,
        params,
        transform_non_params=lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                                   sharding=replicated),
        is_leaf=lambda x: x is None,
    )
    return params, opt_state, frozen


def abstract_train_inputs(model, mesh, batch: int, seq_len: int, config: TrainConfig) -> tuple:
    """The sharded abstract arguments of `train_step_jit` (params, opt_state, step,
    frozen, batch) for `batch` rows of `seq_len` tokens."""
    params, opt_state, frozen = abstract_train_state(model, mesh, config)
    b = Batch(
        _sds((batch, seq_len), jnp.int32, mesh, "batch"),
        _sds((batch, seq_len), jnp.int32, mesh, "batch"),
        _sds((batch, seq_len), jnp.float32, mesh, "batch"),
        _sds((batch,), jnp.int32, mesh, "batch"),
        adapter_ids=_sds((batch,), jnp.int32, mesh, "batch") if has_bank(model) else None,
    )
    return params, opt_state, _sds((), jnp.int32, mesh), frozen, b


def compile_train_step(model, mesh, batch: int, seq_len: int, config: TrainConfig):
    """Lower and compile `train_step_jit` for abstract, sharded inputs (`remat="auto"`
    resolved for them); returns the compiled step."""
    params, opt_state, step, frozen, b = abstract_train_inputs(model, mesh, batch, seq_len, config)
    with jax.set_mesh(mesh):
        config = resolve_remat(params, opt_state, step, frozen, b, config)
        return train_step_jit.lower(params, opt_state, step, frozen, b, config).compile()


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
    tokens = _sds((prompts, round_up(prompt_len, chunk)), jnp.int32, mesh, "batch")
    prompt_lengths = _sds((prompts,), jnp.int32, mesh, "batch")
    padded = tokens.shape[1]  # a prefill chunk lands whole in the cache (`generation.plan_requests`)
    if n == 1:
        cache = decode_cache = new_cache(config, batch, max(prompt_len + new_tokens, padded), cache_dtype, mesh=mesh,
                                         abstract=True)
    else:
        cache = new_cache(config, prompts, max(prompt_len, padded), cache_dtype, mesh=mesh, abstract=True)
        completion = new_cache(config, batch, new_tokens, cache_dtype, mesh=mesh, abstract=True)
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
        step=_sds((), jnp.int32, mesh),
    )
    sampler = jax.eval_shape(lambda: SamplerArrays.from_params([SamplingParams()] * batch, (0,), V))
    sampler = jax.tree.map(lambda x: _sds(x.shape, x.dtype, mesh, "batch"), sampler)
    with jax.set_mesh(mesh):
        pre = prefill.lower(model, cache, tokens, prompt_lengths, chunk=chunk, compute=compute, full_logits=full_logits)
        dec = decode.lower(model, state, sampler, jax.ShapeDtypeStruct((), jnp.int32), compute=compute)
        return {"prefill": pre.compile(), "decode": dec.compile()}


def compile_engine_step(model, mesh, engine: EngineConfig, *, compute: ComputeConfig):
    """Compile `eqx_tx.Engine`'s steps with every slot running, for the engine `engine`
    describes: a prefill chunk of `prefill_rows` requests (beside `max_seqs` decode
    rows in one pass, with `mixed_steps`) and a decode step of `max_seqs` sequences of
    up to `max_seq_len` tokens (default: the pool) over a page pool of
    `max_tokens_in_cache` tokens (`kv_cache_dtype` "auto": bf16). Returns
    `{"mixed" or "prefill": compiled, "decode": compiled}`."""
    max_seqs, page_size, prefill_rows, prefill_chunk = (engine.max_seqs, engine.page_size, engine.prefill_rows,
                                                        engine.prefill_chunk)
    max_seq_len = engine.max_seq_len or engine.num_pages * page_size
    cache_dtype = jnp.bfloat16 if engine.kv_cache_dtype == "auto" else jnp.dtype(engine.kv_cache_dtype)
    config = model.config
    cache = new_paged_cache(config, pages=engine.num_pages, page_size=page_size, batch=max_seqs,
                            pages_per_seq=ceil_div(max_seq_len, page_size), dtype=cache_dtype, mesh=mesh, abstract=True)
    pages_per_seq = cache.page_table.shape[1]
    rows = _sds((max_seqs,), jnp.int32, mesh)
    table = _sds((max_seqs, pages_per_seq), jnp.int32, mesh)
    logits = _sds((max_seqs, config.vocab_size), jnp.float32, mesh, None, "act_vocab")
    sampler = jax.eval_shape(lambda: SamplerArrays.from_params([SamplingParams()] * max_seqs, (0,), config.vocab_size))
    sampler = jax.tree.map(lambda x: _sds(x.shape, x.dtype, mesh), sampler)
    bank = has_bank(model)  # each row's adapter, as the engine passes it
    with jax.set_mesh(mesh):
        prows = _sds((prefill_rows,), jnp.int32, mesh)
        prefill = (prows, _sds((prefill_rows, pages_per_seq), jnp.int32, mesh),
                   _sds((prefill_rows, prefill_chunk), jnp.int32, mesh), prows, prows)
        decode = (rows, table, rows, rows)
        dec = paged_decode_step.lower(model, cache, logits, *decode, rows if bank else None, sampler, compute=compute)
        if engine.mixed_steps:
            both = _sds((prefill_rows + max_seqs,), jnp.int32, mesh) if bank else None
            mixed = paged_mixed_step.lower(model, cache, logits, prefill, decode, both, sampler, compute=compute)
            return {"mixed": mixed.compile(), "decode": dec.compile()}
        pre = paged_prefill_chunk.lower(model, cache, logits, *prefill, prows if bank else None, compute=compute)
        return {"prefill": pre.compile(), "decode": dec.compile()}
