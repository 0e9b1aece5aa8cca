"""`remat="auto"`: the fastest remat policy whose compiled step fits a memory budget.

Each candidate policy is traced (cheap) and its matmul FLOPs counted
(`eqx_tx.core.flops`): recomputation is the difference between policies. Candidates are
then compiled in order of FLOPs, fewer host bytes moved breaking ties (`offload`
does the work of `full` plus the transfers), and the first whose per-device
memory (`compiled.memory_analysis()`) fits the budget is chosen. Nothing runs on
the device; the choice and the figures are logged once.
"""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax

from ..core.compute import ComputeConfig
from ..core.flops import traced_flops
from ..core.log import log_once
from ..core.memory_figures import MemoryFigures

DEFAULT_MEMORY_FRACTION = 0.75
"""JAX's default GPU allocator cap, as a fraction of device memory."""

# Fastest first, by design; the measured FLOPs decide the order.
CANDIDATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ()),
    ("dots", ()),
    ("names", ("q", "k", "v", "attention", "mlp_hidden")),
    ("full", ()),
    # The attention output and the splash kernel's residuals (TPU): the backward pass
    # does not rerun the forward kernel. With the blockwise or cuDNN kernels, whose
    # residuals are not kept, it counts as `full`, and ties keep this order.
    ("names", ("attention",)),
    ("offload", ()),
)


@dataclasses.dataclass(frozen=True)
class RematFigures:
    """One candidate's cost: matmul FLOPs (global, recomputation included) and, once
    compiled, peak device bytes, host bytes and the bytes it moves to and from the
    host per step (per device)."""

    compute: ComputeConfig
    flops: int
    device_bytes: int | None = None
    host_bytes: int = 0
    host_moved: int = 0
    refused: bool = False
    """The compiler refused it as too big for the device (a TPU's does)."""

    @property
    def label(self) -> str:
        return remat_label(self.compute)


def remat_label(compute: ComputeConfig) -> str:
    """The policy and the tensors it names, e.g. `names(q,k,v)`."""
    return compute.remat + (f"({','.join(compute.remat_names)})" if compute.remat_names else "")


def remat_candidates(compute: ComputeConfig) -> list[ComputeConfig]:
    """`compute` with each candidate policy in place of `auto`."""
    return [dataclasses.replace(compute, remat=remat, remat_names=names) for remat, names in CANDIDATES]  # type: ignore[arg-type]


def device_budget(device: Any, fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """Bytes a program may use on `device`: the allocator's limit on an accelerator
    (JAX's default is 0.75 of its memory), `fraction` of physical memory shared by
    the local devices on CPU."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        raise ValueError(f"cannot read the memory of {device}: give the budget (ComputeConfig.memory_budget_gib)")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical * fraction / jax.local_device_count("cpu"))


def choose_remat(
    trace: Callable[[ComputeConfig], jax.stages.Traced], compute: ComputeConfig, budget_bytes: int
) -> tuple[ComputeConfig, list[RematFigures]]:
    """The fastest candidate whose compiled program fits `budget_bytes` per device.

    **Arguments:**

    - `trace`: traces the step for a given `ComputeConfig` (`jax.jit(f).trace`).
    - `compute`: the settings with `remat="auto"`; everything but the policy is kept.
    - `budget_bytes`: peak device bytes allowed per device.

    **Returns:** the chosen settings and every candidate's figures (compiled ones up
    to the choice). Raises `ValueError` naming the budget and the smallest candidate
    if none fits.
    """
    traced = [(c, trace(c)) for c in remat_candidates(compute)]
    figures = sorted((RematFigures(c, traced_flops(t)) for c, t in traced), key=lambda f: (f.flops, f.compute.remat == "offload"))
    by_config = dict(traced)
    chosen = None
    for i, f in enumerate(figures):
        try:
            m = MemoryFigures.of(by_config[f.compute].lower().compile())
        except jax.errors.JaxRuntimeError as e:  # a TPU compiler refuses what does not fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            figures[i] = dataclasses.replace(f, refused=True)
            continue
        figures[i] = dataclasses.replace(f, device_bytes=m.total, host_bytes=m.host_total, host_moved=m.host_moved)
        if m.total <= budget_bytes:
            chosen = figures[i]
            break
    table = "; ".join(
        f"{f.label}: {f.flops / 1e12:.2f} TFLOP, "
        + ("too big for the device (compiler)" if f.refused
           else "not compiled" if f.device_bytes is None else f"{f.device_bytes / 2**30:.2f} GiB")
        + (f" (+{f.host_bytes / 2**30:.2f} GiB host, {f.host_moved / 2**30:.2f} GiB moved)" if f.host_bytes else "")
        for f in figures
    )
    if chosen is None:
        measured = [f for f in figures if f.device_bytes is not None]
        least = min(measured, key=lambda f: f.device_bytes or 0) if measured else None
        smallest = ("the compiler refused every one as too big for the device" if least is None
                    else f"the smallest is {least.label} at {(least.device_bytes or 0) / 2**30:.2f} GiB")
        raise ValueError(
            f'remat="auto": no policy fits the budget of {budget_bytes / 2**30:.2f} GiB per device; {smallest} '
            f"({table}). Use a smaller batch, micro_batches, sequence parallelism or more devices."
        )
    log_once(f'remat="auto" chose {chosen.label} for a budget of {budget_bytes / 2**30:.2f} GiB per device ({table})')
    return chosen.compute, figures
