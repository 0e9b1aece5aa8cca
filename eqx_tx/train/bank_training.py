"""Many trainees over one base model: each slot of a LoRA bank is its own training run.

`BankTrainer` holds a model with a LoRA bank (`apply_lora(..., adapters=n)`), a
float32 gradient buffer and AdamW moments shaped like the bank, and one step count
per slot. `forward_backward` scores a list of datums of one slot through the chunked
LM head and, unless forward-only, adds their gradients to the buffer (only that slot's
part is non-zero); `adamw_step` updates one slot with the hyperparameters of that
call and clears its gradients. Slots never touch each other: another slot's weights,
moments, gradients and count are bit-for-bit unchanged by a slot's calls.

The update is PyTorch's `AdamW` (decoupled weight decay `p *= 1 - lr * wd`, bias
corrections, `eps` added to `sqrt(v_hat)`), after clipping the slot's global gradient
norm to `grad_clip_norm` as `torch.nn.utils.clip_grad_norm_` does (0: no clipping).

Datums are packed by token budget (`eqx_tx.train.token_budget.pack_by_tokens`) into
rows of a power-of-two length, each datum computed as if alone, and run in groups of
rows of about `tokens_per_call` tokens, so a handful of shapes is ever compiled and a
long datum trains beside many short ones without padding them all.

A slot of rank `r` below the bank's rank `R` keeps its rows `r..R` of `lora_A` (and
the matching columns of `lora_B`) at zero: their gradients are zero, so they stay zero
and the slot is exactly a rank-`r` adapter with the bank's scaling `alpha / R`.
Projections a slot does not train (attention or MLP) hold `A = B = 0` likewise.
"""

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..core.log import log_once
from ..core.util import has_pinned_host
from ..layers.lora import ATTENTION_TARGETS, MLP_TARGETS, lora_filter, lora_settings, select_adapters
from ..models import CausalLM
from .bank_optimizer import bank_axes
from .batch import Batch, per_token
from .loss import DEFAULT_CHUNK_SIZE, sequence_logprobs
from .objectives import token_losses
from .remat_auto import choose_remat, device_budget
from .token_budget import pack_by_tokens


@dataclasses.dataclass(frozen=True)
class Datum:
    """One sequence of a `forward_backward` call, as host arrays of its length `N`."""

    tokens: Int[np.ndarray, " n"]
    targets: Int[np.ndarray, " n"]
    weights: Float[np.ndarray, " n"]
    sampler_logprobs: Float[np.ndarray, " n"]
    advantages: Float[np.ndarray, " n"]
    ratio_mask: Float[np.ndarray, " n"] | None = None
    """`gspo`: the tokens whose log-ratios make the sequence ratio (default: all)."""


@dataclasses.dataclass(frozen=True)
class AdamWParams:
    """One step's hyperparameters (PyTorch `AdamW`'s meaning)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Clip the slot's global gradient norm to this (0: no clipping)."""

    def __post_init__(self):
        checks = {"learning_rate": self.learning_rate >= 0, "beta1": 0 <= self.beta1 < 1,
                  "beta2": 0 <= self.beta2 < 1, "eps": self.eps > 0, "weight_decay": self.weight_decay >= 0,
                  "grad_clip_norm": self.grad_clip_norm >= 0}
        for name, ok in checks.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and ok):
                raise ValueError(f"adam_params.{name} = {value} is out of range")


class _Rows(Batch):
    """Packed rows, and for each position the flat index (+1) of the datum token it holds
    (`source`) and its `Datum.ratio_mask`."""

    source: Int[np.ndarray, "batch seq"] | None = per_token()
    ratio_mask: Float[np.ndarray, "batch seq"] | None = per_token()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("kind", "compute", "chunk_size", "backward"), donate_argnames="grads")
def _score_rows(params, frozen, grads, rows: _Rows, config, *, kind: str, compute: ComputeConfig,
                chunk_size: int, backward: bool):
    """Log-probs and per-position losses of `rows`; with `backward`, `grads` plus their gradients."""
    ids, targets, lengths = (jnp.asarray(x) for x in (rows.input_ids, rows.target_ids, rows.lengths))
    segments = jnp.asarray(rows.segment_ids)
    mask = (jnp.asarray(rows.source) != 0).astype(jnp.float32)  # a datum's position (not padding)
    weights = jnp.asarray(rows.loss_weights, jnp.float32) * mask

    def loss(params):
        model = select_adapters(eqx.combine(params, frozen), jnp.asarray(rows.adapter_ids))
        linear = kind == "cross_entropy"
        scores = sequence_logprobs(model, ids, targets, lengths, compute=compute, chunk_size=chunk_size,
                                   segment_ids=segments, token_weights=weights if linear else None)
        logp = jax.lax.stop_gradient(scores.logprobs)
        if linear:  # its LM-head gradients come with the forward pass
            assert scores.weighted_sum is not None
            return -scores.weighted_sum, (logp, -weights * logp)
        B, T = ids.shape
        sequence_ids = jnp.arange(B)[:, None] * (T + 1) + segments  # one id per packed datum
        per = token_losses(kind, scores.logprobs, mask, weights, jnp.asarray(rows.sampler_logprobs, jnp.float32),
                           jnp.asarray(rows.advantages, jnp.float32), config,
                           ratio_mask=jnp.asarray(rows.ratio_mask, jnp.float32), sequence_ids=sequence_ids,
                           num_sequences=B * (T + 1))
        return jnp.sum(per), (logp, jax.lax.stop_gradient(per))

    if not backward:
        _, (logp, per) = loss(params)
        return grads, logp, per
    (_, (logp, per)), g = jax.value_and_grad(loss, has_aux=True)(params)
    grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
    return grads, logp, per


def _adamw(p, g, m, v, count, hp):
    """PyTorch's AdamW on one slot's leaves (after `clip_grad_norm_`); returns the new
    weights and moments, and the gradient norm before clipping."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in g))
    clip = hp["grad_clip_norm"]
    scale = jnp.where(clip > 0, jnp.minimum(1.0, clip / (norm + 1e-6)), 1.0)
    lr, b1, b2, eps, wd = (hp[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"))
    t = count.astype(jnp.float32)
    step_size = lr / (1 - b1**t)
    root_bc2 = jnp.sqrt(1 - b2**t)
    new_p, new_m, new_v = [], [], []
    for x_p, x_g, x_m, x_v in zip(p, g, m, v):
        x_g = x_g.astype(jnp.float32) * scale
        new_m.append(b1 * x_m + (1 - b1) * x_g)
        new_v.append(b2 * x_v + (1 - b2) * x_g * x_g)
        update = step_size * new_m[-1] / (jnp.sqrt(new_v[-1]) / root_bc2 + eps)
        new_p.append((x_p.astype(jnp.float32) * (1 - lr * wd) - update).astype(x_p.dtype))
    return new_p, new_m, new_v, norm


def _take(tree, slot, axes):
    return [jnp.take(x, slot, axis=a) for x, a in zip(jax.tree.leaves(tree), axes)]


def _put(tree, values, slot, axes):
    leaves = [_write_slot(x, y, slot, a) for x, y, a in zip(jax.tree.leaves(tree), values, axes)]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


@functools.partial(jax.jit, static_argnames="axes", donate_argnames=("params", "grads", "m", "v"))
def _adamw_slot(params, grads, m, v, slot, count, hp, *, axes: tuple[int, ...]):
    """`_adamw` on slot `slot` of every bank leaf (leaf `i`'s slot axis `axes[i]`), the
    moments held as banks too; the slot's gradients are cleared."""
    p, g, m_slot, v_slot = (_take(t, slot, axes) for t in (params, grads, m, v))
    p, mm, vv, norm = _adamw(p, g, m_slot, v_slot, count, hp)
    cleared = [jnp.zeros_like(x) for x in _take(grads, slot, axes)]
    return (_put(params, p, slot, axes), _put(grads, cleared, slot, axes), _put(m, mm, slot, axes),
            _put(v, vv, slot, axes), norm)


@functools.partial(jax.jit, static_argnames="axes", donate_argnames=("params", "grads"))
def _adamw_slot_moments(params, grads, m, v, slot, count, hp, *, axes: tuple[int, ...]):
    """`_adamw_slot` with the moments of the slot alone (lists of its leaves), returned."""
    p, mm, vv, norm = _adamw(_take(params, slot, axes), _take(grads, slot, axes), m, v, count, hp)
    cleared = [jnp.zeros_like(x) for x in _take(grads, slot, axes)]
    return _put(params, p, slot, axes), _put(grads, cleared, slot, axes), mm, vv, norm


class BankTrainer:
    """Train each slot of `model`'s LoRA bank as its own run (module docstring).

    **Arguments:**

    - `model`: a model with a LoRA bank (`apply_lora(..., adapters=n)`). The trainer owns
      the bank's arrays from now on: they are updated in place (donated), so the bank
      passed in is not to be used again.
    - `compute`: attention implementation, remat policy (`"auto"`: the fastest that fits
      the memory budget, chosen per shape of call).
    - `chunk_size`: tokens per LM-head chunk.
    - `tokens_per_call`: about how many tokens one compiled call scores (rows of one
      call: this over the row length, a power of two, at least one).
    - `min_row`: the shortest packed row (row lengths are powers of two from it).
    - `offload_moments`: keep each slot's AdamW moments in host memory (pinned host
      memory where the platform has it, else host RAM) between its steps: the device
      holds the moments of the slot being updated only, not of every slot of the bank.
    """

    def __init__(self, model: CausalLM, *, compute: ComputeConfig = ComputeConfig(),
                 chunk_size: int = DEFAULT_CHUNK_SIZE, tokens_per_call: int = 16384, min_row: int = 128,
                 offload_moments: bool = False):
        settings = lora_settings(model)
        if settings["adapters"] is None:
            raise ValueError("BankTrainer needs a model with a LoRA bank (apply_lora(..., adapters=n))")
        self.slots, self.rank, self.targets = settings["adapters"], settings["rank"], settings["targets"]
        self.params, self.frozen = eqx.partition(model, lora_filter(model))
        self._axes = tuple(jax.tree.leaves(bank_axes(self.params)))
        self._names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(self.params)[0]]
        zeros = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))
        self.grads = zeros(self.params)
        self.offload_moments = offload_moments
        self.m, self.v = (None, None) if offload_moments else (zeros(self.params), zeros(self.params))
        self._host_moments: dict[int, tuple[list, list]] = {}  # offloaded: slot -> (m, v) leaves on the host
        self.counts = [0] * self.slots
        self.compute, self.chunk_size = compute, chunk_size
        self._resolved: dict = {}  # remat="auto": (row shape, objective, backward) -> the chosen compute
        self.tokens_per_call, self.min_row = tokens_per_call, min_row

    @property
    def model(self) -> CausalLM:
        return eqx.combine(self.params, self.frozen)

    # -- slots -----------------------------------------------------------------------------

    def init_slot(self, slot: int, *, rank: int, train_attn: bool = True, train_mlp: bool = True,
                  seed: int | None = None) -> None:
        """Start slot `slot` afresh: a PEFT-initialised adapter of `rank` (`A`
        Kaiming-uniform, `B = 0`) on the trained projections, zero moments and
        gradients, step count 0."""
        self._check_slot(slot)
        if not 1 <= rank <= self.rank:
            raise ValueError(f"LoRA rank {rank} is outside [1, {self.rank}] (the server's maximum rank)")
        trained = (ATTENTION_TARGETS if train_attn else ()) + (MLP_TARGETS if train_mlp else ())
        key = jax.random.key(int.from_bytes(os.urandom(4), "little") if seed is None else seed)
        values = {}
        for i, (name, leaf, axis) in enumerate(zip(self._names, jax.tree.leaves(self.params), self._axes)):
            shape = leaf.shape[:axis] + leaf.shape[axis + 1:]
            if ".lora_A." in name and any(f".{t}." in name for t in trained):
                fan_in = math.prod(shape[axis + 1:])
                bound = 1.0 / math.sqrt(fan_in)
                a = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
                keep = (jnp.arange(shape[axis]) < rank).reshape((-1,) + (1,) * (len(shape) - axis - 1))
                values[name] = jnp.where(keep, a, 0.0)
            else:
                values[name] = jnp.zeros(shape, jnp.float32)
        self.set_slot(slot, {"params": values})

    def slot_state(self, slot: int) -> dict[str, dict[str, np.ndarray]]:
        """Slot `slot`'s weights (`params`) and AdamW moments (`m`, `v`), as host arrays by leaf name."""
        self._check_slot(slot)
        out = {"params": dict(zip(self._names, (np.asarray(x) for x in _take(self.params, slot, self._axes))))}
        m, v = self._slot_moments(slot)
        out["m"], out["v"] = (dict(zip(self._names, (np.asarray(x) for x in t))) for t in (m, v))
        return out

    def _slot_shapes(self) -> list[tuple[int, ...]]:
        return [x.shape[:a] + x.shape[a + 1:] for x, a in zip(jax.tree.leaves(self.params), self._axes)]

    def _slot_moments(self, slot: int) -> tuple[list, list]:
        """Slot `slot`'s moments (leaf lists) on the device."""
        if not self.offload_moments:
            assert self.m is not None and self.v is not None
            return _take(self.m, slot, self._axes), _take(self.v, slot, self._axes)
        if slot not in self._host_moments:
            zeros = [jnp.zeros(shape, jnp.float32) for shape in self._slot_shapes()]
            return zeros, list(zeros)
        return tuple([_on_device(x) for x in t] for t in self._host_moments[slot])  # type: ignore[return-value]

    def set_slot(self, slot: int, state: dict[str, dict], *, count: int = 0) -> None:
        """Write slot `slot`: its `params` (required) and moments `m`, `v` (zeros if absent);
        its gradients are cleared and its step count set to `count`."""
        self._check_slot(slot)
        parts = {"params": self.params, "m": self.m, "v": self.v, "grads": self.grads}
        if self.offload_moments:
            self._host_moments.pop(slot, None)
            if state.get("m") is not None:
                moments = [[np.asarray(state[k][n], np.float32) for n in self._names] for k in ("m", "v")]
                for values, shape in zip(moments[0], self._slot_shapes()):
                    if values.shape != shape:
                        raise ValueError(f"moments: shape {values.shape}, the bank's slots hold {shape}")
                self._host_moments[slot] = (_to_host(moments[0]), _to_host(moments[1]))
            parts = {"params": self.params, "grads": self.grads}
        for part, tree in parts.items():
            given = state.get(part)
            values = []
            for name, x, shape in zip(self._names, jax.tree.leaves(tree), self._slot_shapes()):
                value = jnp.zeros(shape, x.dtype) if given is None else jnp.asarray(given[name], x.dtype)
                if value.shape != shape:
                    raise ValueError(f"{part} {name}: shape {value.shape}, the bank's slots hold {shape}")
                values.append(value)
            parts[part] = _write_slots(tree, values, jnp.asarray(slot, jnp.int32), axes=self._axes)
        self.params, self.grads = parts["params"], parts["grads"]
        self.m, self.v = parts.get("m", self.m), parts.get("v", self.v)
        self.counts[slot] = count

    def clear_gradients(self, slot: int) -> None:
        """Drop slot `slot`'s accumulated gradients."""
        self._check_slot(slot)
        zeros = [jnp.zeros(shape, jnp.float32) for shape in self._slot_shapes()]
        self.grads = _write_slots(self.grads, zeros, jnp.asarray(slot, jnp.int32), axes=self._axes)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside the bank's {self.slots} slots")

    # -- steps -----------------------------------------------------------------------------

    def forward_backward(self, slots: int | Sequence[int], datums: Sequence[Datum], kind: str,
                         config: dict[str, float], *, backward: bool = True
                         ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Score `datums` under objective `kind` (`eqx_tx.train.objectives`), each with its
        slot (`slots`: one for all, or one per datum: several runs in one batch); with
        `backward`, add the gradient of their summed loss to each slot's buffer.

        **Returns:** each datum's per-position log-probabilities and losses (its loss is their sum).
        """
        ids = [slots] * len(datums) if isinstance(slots, int) else list(slots)
        if len(ids) != len(datums):
            raise ValueError(f"{len(ids)} slots for {len(datums)} datums")
        for slot in set(ids):
            self._check_slot(slot)
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        rows, offsets = self._pack(ids, datums)
        n_rows, length = rows.input_ids.shape
        group = min(n_rows, max(1, _prev_pow2(self.tokens_per_call // length)))
        total = offsets[-1]
        logp_flat = np.zeros(total + 1, np.float32)
        loss_flat = np.zeros(total + 1, np.float32)
        cfg = {k: jnp.asarray(v, jnp.float32) for k, v in config.items()}
        for start in range(0, n_rows, group):
            part = jax.tree.map(lambda x: x[start:start + group], rows)
            compute = self._compute_for(part, cfg, kind, backward)
            self.grads, logp, per = _score_rows(self.params, self.frozen, self.grads, part, cfg, kind=kind,
                                                compute=compute, chunk_size=self.chunk_size, backward=backward)
            source = np.asarray(part.source)
            logp_flat[source] = np.asarray(logp)  # index 0 collects the padding
            loss_flat[source] = np.asarray(per)

        def split(flat):
            return [flat[1 + offsets[i]:1 + offsets[i + 1]] for i in range(len(datums))]

        return split(logp_flat), split(loss_flat)

    def _compute_for(self, part: _Rows, config, kind: str, backward: bool) -> ComputeConfig:
        """`self.compute`, with `remat="auto"` resolved for this shape of call: the fastest
        policy whose compiled program fits the budget (`eqx_tx.train.remat_auto`), chosen
        once per row shape, objective and direction."""
        if self.compute.remat != "auto":
            return self.compute
        key = (tuple(part.input_ids.shape), kind, backward)
        if key not in self._resolved:
            gib = self.compute.memory_budget_gib
            budget = int(gib * 2**30) if gib is not None else device_budget(jax.devices()[0])

            def trace(compute: ComputeConfig):
                return _score_rows.trace(self.params, self.frozen, self.grads, part, config, kind=kind,
                                         compute=compute, chunk_size=self.chunk_size, backward=backward)

            self._resolved[key], _ = choose_remat(trace, self.compute, budget)
        return self._resolved[key]

    def adamw_step(self, slot: int, params: AdamWParams) -> float:
        """One AdamW step of slot `slot` on its accumulated gradients, which are then
        cleared. **Returns:** the gradient norm before clipping."""
        self._check_slot(slot)
        self.counts[slot] += 1
        hp = {k: jnp.asarray(v, jnp.float32) for k, v in dataclasses.asdict(params).items()}
        index, count = jnp.asarray(slot, jnp.int32), jnp.asarray(self.counts[slot], jnp.int32)
        if self.offload_moments:
            m, v = self._slot_moments(slot)
            self.params, self.grads, m, v, norm = _adamw_slot_moments(self.params, self.grads, m, v, index, count,
                                                                      hp, axes=self._axes)
            self._host_moments[slot] = (_to_host(m), _to_host(v))
        else:
            self.params, self.grads, self.m, self.v, norm = _adamw_slot(self.params, self.grads, self.m, self.v,
                                                                        index, count, hp, axes=self._axes)
        return float(norm)

    def _pack(self, slots: list[int], datums: Sequence[Datum]) -> tuple[_Rows, np.ndarray]:
        """The datums packed into rows of one slot each (`_Rows.source`: 1 + flat token
        index), and each datum's offset into the flat token order."""
        lens = np.asarray([len(d.tokens) for d in datums])
        offsets = np.concatenate([[0], np.cumsum(lens)])
        longest = int(lens.max())
        length = max(self.min_row, _next_pow2(longest))
        B = len(datums)

        def stack(field: str, dtype):
            out = np.zeros((B, longest), dtype)
            for i, d in enumerate(datums):
                out[i, :lens[i]] = getattr(d, field)
            return out

        ratio_mask = np.zeros((B, longest), np.float32)
        for i, d in enumerate(datums):
            ratio_mask[i, :lens[i]] = 1.0 if d.ratio_mask is None else d.ratio_mask
        source = np.zeros((B, longest), np.int32)
        for i in range(B):
            source[i, :lens[i]] = 1 + offsets[i] + np.arange(lens[i])
        batch = _Rows(input_ids=stack("tokens", np.int32), target_ids=stack("targets", np.int32),
                      loss_weights=stack("weights", np.float32), lengths=lens.astype(np.int32),
                      sampler_logprobs=stack("sampler_logprobs", np.float32),
                      advantages=stack("advantages", np.float32), source=source, ratio_mask=ratio_mask,
                      adapter_ids=np.asarray(slots, np.int32))
        rows, _ = pack_by_tokens(batch, length)
        assert isinstance(rows, _Rows)  # pack_by_tokens keeps the batch's class
        return rows, offsets


def _to_host(leaves: list) -> list:
    """Moments to where they wait between steps: pinned host memory, or host RAM."""
    if has_pinned_host():
        leaves = [jnp.asarray(x) for x in leaves]
        return [jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in leaves]
    log_once("BankTrainer(offload_moments=True): no pinned host memory on this platform; moments wait in host RAM")
    return [np.asarray(x) for x in leaves]


def _on_device(x):
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    return jax.device_put(x, x.sharding.with_memory_kind("device"))


def _prev_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _write_slot(x: Array, value: Array, slot: int, axis: int) -> Array:
    return jax.lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), slot, axis)


@functools.partial(jax.jit, static_argnames="axes", donate_argnames="tree")
def _write_slots(tree, values, slot, *, axes: tuple[int, ...]):
    """`tree` (a bank, donated: written in place) with slot `slot` of leaf `i` set to `values[i]`."""
    return _put(tree, values, slot, axes)
