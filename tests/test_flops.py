"""Matmul FLOPs read from a jaxpr (`eqx_tx.core.flops`), against counts worked out by hand."""

import jax
import jax.numpy as jnp

from eqx_tx.core.flops import traced_flops
from eqx_tx.kernels.splash import splash_attention


def test_dots_and_scan_bodies_times_their_length():
    w_in, w = jnp.ones((64, 32)), jnp.ones((5, 32, 32))

    def f(x):  # [8, 64] @ [64, 32] once, then a scan of 5 [8, 32] @ [32, 32]
        y, _ = jax.lax.scan(lambda c, wi: (c @ wi + 1.0, None), x @ w_in, w)
        return y

    assert traced_flops(jax.jit(f).trace(jnp.ones((8, 64)))) == 2 * 8 * 64 * 32 + 5 * 2 * 8 * 32 * 32


def test_pallas_kernels_count_once_per_grid_point():
    """Splash (the Pallas TPU kernel, traced on CPU) over every tile of its grid:
    QKᵀ and PV forward; the backward's kernel recomputes QKᵀ and forms dP, dV, dK, dQ,
    after the row sums of dO·O outside it."""
    B, T, H, K = 2, 512, 2, 128
    q, kv = jnp.ones((B, T, H, K)), jnp.ones((B, T, 1, K))
    loss = lambda q, k, v: splash_attention(q, k, v, block_q=256, block_kv=256).sum()  # noqa: E731
    matmul = 2 * B * H * T * T * K  # one [T, K] x [K, T] product per (batch, head), every tile counted
    assert traced_flops(jax.jit(loss).trace(q, kv, kv)) == 2 * matmul
    row_sums = 2 * B * H * T * K
    assert traced_flops(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv)) == (2 + 5) * matmul + row_sums
