"""One jitted, buffer-donating training step: chunked loss, gradients, AdamW.

Parameters are split (`eqx.partition`) into the trainable part and the frozen rest;
only the trainable part has gradients and optimizer state, so a LoRA run holds no
optimizer or gradient buffer for the base weights. Gradient accumulation is a
`lax.scan` over micro-batches inside the step.
"""

import dataclasses
import functools
import logging
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, Int

from ..core.compute import ComputeConfig
from ..core.distributed import batch_sharding
from ..core.log import log_once
from ..core.sharding import mesh_context, mesh_of
from ..layers.linear import Embedding, Linear
from ..layers.lora import check_adapter_ids, has_bank, lora_settings, select_adapters, trainable_filter
from ..models import CausalLM
from .bank_optimizer import adapters_present, init_bank_state, update_bank
from .batch import Batch
from .forward import check_segment_ids
from .loss import DEFAULT_CHUNK_SIZE, sequence_logprobs
from .policy import PolicyLoss, nonzero_count, policy_objective, token_coefficients
from .remat_auto import choose_remat, device_budget
from .token_budget import pack_by_tokens


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay, global-norm clipping."""

    learning_rate: float = 3e-4
    """Peak learning rate."""
    warmup_steps: int = 0
    """Steps of linear warmup: the rate at (0-based) step s < warmup_steps is
    learning_rate * (s + 1) / warmup_steps."""
    total_steps: int = 1000
    """Steps of the whole schedule: after warmup the rate decays along a cosine to
    learning_rate * min_lr_ratio at this step."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.0
    """Decoupled weight decay, on matrices (projections, embeddings, adapters) only,
    not on norms or biases."""
    b1: float = 0.9
    """Adam's first-moment decay."""
    b2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global norm (None: no clipping)."""

    def __post_init__(self):
        def check(name: str, ok: bool, wanted: str):
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be {wanted}, got {getattr(self, name)}")

        check("learning_rate", math.isfinite(self.learning_rate) and self.learning_rate > 0, "a finite number > 0")
        check("total_steps", self.total_steps >= 1, ">= 1")
        check("warmup_steps", self.warmup_steps >= 0, ">= 0")
        if self.warmup_steps > self.total_steps:
            log_once(f"warmup_steps={self.warmup_steps} (--warmup-steps) is longer than total_steps={self.total_steps} "
                     "(--total-steps): the learning rate never reaches its peak", level=logging.WARNING)
        check("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]")
        check("weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0, "a finite number >= 0")
        check("b1", 0 <= self.b1 < 1, "in [0, 1)")
        check("b2", 0 <= self.b2 < 1, "in [0, 1)")
        check("eps", math.isfinite(self.eps) and self.eps > 0, "a finite number > 0")
        check("max_grad_norm", self.max_grad_norm is None or (math.isfinite(self.max_grad_norm)
                                                               and self.max_grad_norm > 0), "> 0 (or None)")

    def schedule(self, count: Int[ArrayLike, ""]) -> Float[Array, ""]:
        """The learning rate at step `count`."""
        step = jnp.asarray(count, jnp.float32)
        warm = max(self.warmup_steps, 1)
        warmup = self.learning_rate * jnp.minimum(1.0, (step + 1) / warm)
        progress = jnp.clip((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 0.0, 1.0)
        cosine = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < self.warmup_steps, warmup, self.learning_rate * cosine)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static settings of `train_step`."""

    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW and schedule settings."""
    micro_batches: int = 1
    """Split each batch into this many micro-batches, accumulating gradients in
    float32 (the update equals the full-batch update)."""
    loss_chunk_size: int | None = DEFAULT_CHUNK_SIZE
    """Tokens per LM-head chunk (eqx_tx.train.loss); None computes full [batch, seq, vocab]
    logits with plain autodiff (a baseline for benchmarks)."""
    compute: ComputeConfig = ComputeConfig()
    """Attention implementation, remat policy, sequence parallelism."""
    policy_loss: PolicyLoss | None = None
    """A policy-gradient objective (`eqx_tx.train.policy`) on sampled tokens; `None`: the
    weighted cross entropy of supervised fine-tuning."""
    offload_optimizer: bool = False
    """Keep the optimizer state (AdamW moments) in pinned host memory between steps:
    each step brings it to the device for the update and sends it back, so the
    device holds the moments only while it updates them (full fine-tuning of a model
    whose moments do not fit beside it). `init_train_state` places it."""
    max_tokens_per_micro_batch: int | None = None
    """Pack each batch's sequences into rows of this many tokens (segment ids; each
    sequence computed as if alone), one row per data-parallel device per micro-batch,
    instead of splitting rows into `micro_batches` (which it then replaces): one long
    and many short sequences train in one step without padding all to the longest."""

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be >= 1 (or None), got {self.loss_chunk_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1 (or None), got {self.max_tokens_per_micro_batch}")

    def check_batch(self, batch_size: int, data_parallel: int = 1) -> None:
        """Raise if `batch_size` rows do not split into `micro_batches` micro-batches
        of whole rows per data-parallel group (`data_parallel` groups)."""
        if batch_size % self.micro_batches:
            raise ValueError(f"batch size {batch_size} is not divisible by micro_batches={self.micro_batches}")
        if batch_size % (data_parallel * self.micro_batches):
            raise ValueError(
                f"batch size {batch_size} is not divisible by the data-parallel size {data_parallel} "
                f"x micro_batches {self.micro_batches}"
            )


class TrainState(eqx.Module):
    """Trainable parameters, the frozen rest of the model, optimizer state, step."""

    params: CausalLM
    frozen: CausalLM
    opt_state: optax.OptState
    step: Int[Array, ""]

    @property
    def model(self) -> CausalLM:
        return eqx.combine(self.params, self.frozen)


def decay_mask(params):
    """`True` on weight matrices (Linear, Embedding), `False` on norms and biases."""

    def mark(node):
        spec = jax.tree.map(lambda _: False, node)
        if isinstance(node, (Linear, Embedding)) and node.weight is not None:
            spec = eqx.tree_at(lambda m: m.weight, spec, True)
        return spec

    return jax.tree.map(mark, params, is_leaf=lambda x: isinstance(x, (Linear, Embedding)))


def make_optimizer(config: OptimizerConfig, params) -> optax.GradientTransformation:
    parts = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        optax.adamw(
            config.schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask(params),
        )
    )
    return optax.chain(*parts)


def init_train_state(model: CausalLM, config: TrainConfig, *, trainable=None) -> TrainState:
    """Partition `model` and create the optimizer state.

    **Arguments:**

    - `model`: the model (with adapters attached for LoRA).
    - `config`: the training settings.
    - `trainable`: a filter spec of what to train; default: the LoRA adapters if
      the model has any, else every array.
    """
    if trainable is None:
        trainable = trainable_filter(model)
    params, frozen = eqx.partition(model, trainable)
    optimizer = make_optimizer(config.optimizer, params)
    opt_state = init_bank_state(optimizer, params) if has_bank(params) else optimizer.init(params)
    if config.offload_optimizer:
        opt_state = _moments_to(opt_state, lambda x: x.sharding.with_memory_kind("pinned_host"))
    return TrainState(params=params, frozen=frozen, opt_state=opt_state, step=jnp.zeros((), jnp.int32))


def _moments_to(opt_state, where):
    """The optimizer state with its moments (not its step counts) put at `where(x)`."""
    return jax.tree.map(lambda x: jax.device_put(x, where(x)) if x.ndim else x, opt_state)


def _split_micro_batches(tree, m: int):
    """Each `[B, ...]` array to `[m, B/m, ...]`, micro-batch `i` holding rows `i, i+m, ...`.

    The strided split keeps each device's rows on that device when the batch axis
    is sharded (the sharded axis stays the second one, not the scanned one).
    """

    def split(x):
        B = x.shape[0]
        return jnp.swapaxes(x.reshape(B // m, m, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def _micro_batch_loss(params, frozen, batch: Batch, coefficients, config: TrainConfig, count, micro_batches: int):
    """This micro-batch's share of the step's loss: `sum(coefficients * token_loss)`
    (the coefficients of the whole batch: the shares add up to the full-batch loss),
    plus, for MoE models, the load-balancing loss (its mean over micro-batches) times
    its coefficient. Returns `(loss, metrics)`, metrics being shares too."""
    model = eqx.combine(params, frozen)
    if batch.adapter_ids is not None:
        model = select_adapters(model, batch.adapter_ids)
    policy = config.policy_loss
    ids, targets, lengths = (jnp.asarray(x) for x in (batch.input_ids, batch.target_ids, batch.lengths))
    segments = None if batch.segment_ids is None else jnp.asarray(batch.segment_ids)
    # Cross entropy is linear in the log-probabilities: its LM-head gradients come with
    # the forward pass (`token_weights`), instead of from a second pass over the vocabulary.
    logp, entropy, stats, weighted = sequence_logprobs(
        model, ids, targets, lengths, compute=config.compute, chunk_size=config.loss_chunk_size,
        segment_ids=segments, entropy=policy is not None and policy.needs_entropy,
        token_weights=coefficients if policy is None else None)
    if policy is None:
        assert weighted is not None
        objective, metrics = -weighted, {}
    else:
        objective, metrics = policy_objective(logp, entropy, batch, coefficients, count, policy)
    balance = stats.load_balancing_loss() / micro_batches if stats is not None else jnp.zeros(())
    loss = objective + model.config.router_aux_loss_coef * balance
    return loss, {"loss": objective, "load_balancing_loss": balance, **metrics}


def loss_and_grads(params, frozen, batch: Batch, coefficients, config: TrainConfig, count):
    """The step's metrics and float32 gradients, accumulated over micro-batches."""
    grad_fn = jax.grad(_micro_batch_loss, has_aux=True)
    m = config.micro_batches
    if m == 1:
        grads, metrics = grad_fn(params, frozen, batch, coefficients, config, count, 1)
        return metrics, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def body(carry, micro):
        metrics_sum, grad_sum = carry
        grads, metrics = grad_fn(params, frozen, *micro, config, count, m)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (jax.tree.map(jnp.add, metrics_sum, metrics), grad_sum), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    shapes = jax.eval_shape(lambda: grad_fn(params, frozen, batch, coefficients, config, count, m)[1])
    init = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), zeros)
    (metrics, grads), _ = jax.lax.scan(body, init, _split_micro_batches((batch, coefficients), m))
    return metrics, grads


def _coefficients(batch: Batch, config: TrainConfig, adapters: int | None) -> Float[Array, "batch seq"]:
    """Each token's weight in the step's loss, `loss = sum(coefficients * token_loss)`.

    With a bank of `adapters`, each adapter's rows are normalised as if they were the
    whole batch (its own training run), and the step's loss is the sum over adapters.
    """

    def alone(weights):
        if config.policy_loss is None:
            return weights / nonzero_count(weights)
        return token_coefficients(dataclasses.replace(batch, loss_weights=weights), config.policy_loss.normalise)

    weights = jnp.asarray(batch.loss_weights, jnp.float32)
    if adapters is None:
        return alone(weights)
    ids = jnp.asarray(batch.adapter_ids)
    return jnp.sum(jax.vmap(lambda k: alone(weights * (ids == k)[:, None]))(jnp.arange(adapters)), axis=0)


@functools.partial(jax.jit, static_argnames="config", donate_argnames=("params", "opt_state", "step"))
def train_step_jit(params, opt_state, step, frozen, batch: Batch, config: TrainConfig):
    """The jitted step: donates the trainable state; the frozen part is only read.

    Not returning `frozen` matters: a returned input that is not donated would be
    copied, doubling the memory of the frozen base weights in a LoRA run.
    """
    count = nonzero_count(batch.loss_weights)
    adapters = lora_settings(params)["adapters"] if has_bank(params) else None  # the bank's size
    coefficients = _coefficients(batch, config, adapters)
    metrics, grads = loss_and_grads(params, frozen, batch, coefficients, config, count)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    optimizer = make_optimizer(config.optimizer, params)
    if config.offload_optimizer:
        opt_state = _moments_to(opt_state, lambda _: jax.memory.Space.Device)
    if adapters is not None:
        assert batch.adapter_ids is not None
        present = adapters_present(jnp.asarray(batch.adapter_ids), batch.loss_weights, adapters)
        params, opt_state = update_bank(optimizer, grads, opt_state, params, present)
    else:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    if config.offload_optimizer:
        opt_state = _moments_to(opt_state, lambda _: jax.memory.Space.Host)
    metrics = {
        **metrics,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": config.optimizer.schedule(step),
        "tokens": jnp.sum(batch.loss_weights != 0),
    }
    return params, opt_state, step + 1, metrics


_RESOLVED: dict = {}


def resolve_remat(params, opt_state, step, frozen, batch: Batch, config: TrainConfig) -> TrainConfig:
    """`config` with `remat="auto"` replaced by the fastest policy whose compiled
    `train_step_jit` fits the budget (`eqx_tx.train.remat_auto.choose_remat`) for these
    inputs (arrays or sharded `jax.ShapeDtypeStruct`s); other configs unchanged.
    The choice is remembered per config and input shapes/shardings."""
    compute = config.compute
    if compute.remat != "auto":
        return config
    args = (params, opt_state, step, frozen, batch)
    leaves, treedef = jax.tree.flatten(args)
    key = (config, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key not in _RESOLVED:
        if compute.memory_budget_gib is not None:
            budget = int(compute.memory_budget_gib * 2**30)
        else:
            sharding = getattr(leaves[0], "sharding", None)
            budget = device_budget(jax.devices()[0] if sharding is None else min(sharding.device_set, key=lambda d: d.id))

        def trace(c: ComputeConfig):
            return train_step_jit.trace(*args, dataclasses.replace(config, compute=c))

        chosen, _ = choose_remat(trace, compute, budget)
        _RESOLVED[key] = dataclasses.replace(config, compute=chosen)
    return _RESOLVED[key]


def _pack(state: TrainState, batch: Batch, config: TrainConfig) -> tuple[Batch, TrainConfig]:
    """`config.max_tokens_per_micro_batch`: the batch packed by `pack_by_tokens`, placed
    on the state's mesh, and the config with its micro-batch count."""
    budget = config.max_tokens_per_micro_batch
    assert budget is not None
    if jax.process_count() > 1:
        raise ValueError("max_tokens_per_micro_batch packs the whole batch on one host: not available multi-host")
    mesh = mesh_of(state)
    dp = 1 if mesh is None else mesh.shape["dp"] * mesh.shape["ep"]
    host = jax.tree.map(np.asarray, batch)
    packed, micro_batches = pack_by_tokens(host, budget, rows_multiple=dp)
    if mesh is not None:
        packed = jax.device_put(packed, batch_sharding(mesh, packed.input_ids.shape[0]))
    return packed, dataclasses.replace(config, micro_batches=micro_batches, max_tokens_per_micro_batch=None)


def train_step(state: TrainState, batch: Batch, config: TrainConfig) -> tuple[TrainState, dict]:
    """One optimizer step on `batch`.

    The trainable parameters, optimizer state and step of `state` are donated
    (their buffers are reused for the new state); the frozen part is not touched.

    **Returns:** the new state and metrics: `loss` (the mean weighted token NLL, or
    the policy loss with its KL and entropy terms), `load_balancing_loss` (MoE;
    added to the objective times the config's `router_aux_loss_coef`), `grad_norm`
    (before clipping), `learning_rate` (used for this step), `tokens` (number of
    weighted tokens), and with `config.policy_loss` the metrics of
    `eqx_tx.train.policy.policy_objective`.
    """
    if config.max_tokens_per_micro_batch is not None:
        batch, config = _pack(state, batch, config)
    config.check_batch(batch.input_ids.shape[0])
    if config.policy_loss is not None:
        config.policy_loss.check_batch(batch)
    check_adapter_ids(state.params, batch.adapter_ids, batch.input_ids.shape[0])
    if batch.segment_ids is not None:
        check_segment_ids(batch.segment_ids, batch.lengths)
    with mesh_context(state):
        config = resolve_remat(state.params, state.opt_state, state.step, state.frozen, batch, config)
        params, opt_state, step, metrics = train_step_jit(
            state.params, state.opt_state, state.step, state.frozen, batch, config
        )
    return TrainState(params=params, frozen=state.frozen, opt_state=opt_state, step=step), metrics
