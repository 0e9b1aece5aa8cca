"""Matmul FLOPs of a traced program, read from its jaxpr (any backend, no compile).

Compiled cost analysis is not available on every target (the compile-only CUDA
devices return none), and it counts what XLA kept rather than what the program
asks for. Counting `dot_general`s (and fused attention calls) in the jaxpr, dead
code removed, with each `scan` body counted `length` times and each Pallas
kernel's body once per point of its grid, gives the same figure everywhere
(`while` bodies count once); the backward pass of a remat policy shows up as the
forward work it recomputes. The figures are global (before partitioning), for
comparing programs with each other.
"""

import math

import jax
from jax._src.interpreters.partial_eval import dce_jaxpr  # no public equivalent (jax < 0.11 is pinned)
from jax.extend.core import Jaxpr, jaxprs_in_params


def _dot_flops(eqn) -> int:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contract)


def _attention_flops(eqn) -> int:
    """cuDNN fused attention (`jax.nn.dot_product_attention`): q [B, T, N, H] against
    k [B, S, K, H]: two matmuls of 2 B N T S H each (causal masking not discounted)."""
    b, t, n, h = eqn.invars[0].aval.shape
    s = eqn.invars[1].aval.shape[1]
    forward = 4 * b * n * t * s * h
    return forward if "fwd" in eqn.primitive.name else 2 * forward


def jaxpr_flops(jaxpr: Jaxpr) -> int:
    """Matmul FLOPs of `jaxpr`, nested jaxprs included (scan bodies times their length,
    Pallas kernel bodies times their grid)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name.startswith("dot_product_attention_"):
            total += _attention_flops(eqn)
        times = eqn.params["length"] if name == "scan" else 1
        if name == "pallas_call":  # the kernel body runs once per grid point
            times = math.prod(g for g in eqn.params["grid_mapping"].grid if isinstance(g, int))
        for sub in jaxprs_in_params(eqn.params):
            total += times * jaxpr_flops(sub)
    return total


def traced_flops(traced: jax.stages.Traced) -> int:
    """Matmul FLOPs of a `jax.jit(f).trace(...)` result, after removing the work whose
    results are never used (as XLA does): under a remat policy that keeps a Pallas
    kernel's named residuals, the recomputation traced for the backward pass still
    holds the kernel, dead."""
    jaxpr = traced.jaxpr.jaxpr
    live, _ = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return jaxpr_flops(live)
