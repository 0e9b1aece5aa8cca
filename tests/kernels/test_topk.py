"""`eqx_tx.kernels.topk`: `top_k` against `jax.lax.top_k`, `argmax` against `jnp.argmax`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_tx.kernels.topk import argmax, top_k


def _rows(kind: str, n: int, rng) -> np.ndarray:
    if kind == "random":
        return rng.standard_normal((5, n)).astype(np.float32)
    if kind == "ties":  # few distinct values: ties everywhere, also at the k-th value
        return rng.integers(0, 6, (5, n)).astype(np.float32)
    x = rng.standard_normal((5, n)).astype(np.float32)
    x[rng.random((5, n)) < 0.97] = -np.inf  # fewer than k finite values in some rows
    x[0] = -np.inf
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "mostly_inf"])
@pytest.mark.parametrize("n, k, chunk", [(151936, 64, 128), (32000, 20, 128), (1000, 7, 16), (1003, 64, 8), (50, 8, 16)])
def test_same_as_lax_top_k(kind, n, k, chunk):
    x = jnp.asarray(_rows(kind, n, np.random.default_rng(n + k)))
    values, ids = jax.jit(top_k, static_argnames=("k", "chunk"))(x, k=k, chunk=chunk)
    ref_values, ref_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(ids, ref_ids)


def _argmax_rows(kind: str, n: int, rng) -> np.ndarray:
    x = _rows("ties" if kind in ("ties", "nan") else "random", n, rng)
    if kind == "all_inf":
        x[1] = -np.inf
        x[2, : n // 2] = -np.inf
    if kind == "nan":  # the first NaN wins, wherever the maximum is
        x[1, n // 3] = x[1, n - 1] = np.nan
        x[2, 0] = np.nan
    if kind == "inf":
        x[3, n - 1] = np.inf
        x[3, 7] = np.inf
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "all_inf", "nan", "inf"])
@pytest.mark.parametrize("n", [151936, 32000, 1000, 13])
def test_argmax_same_as_jnp(kind, n):
    x = jnp.asarray(_argmax_rows(kind, n, np.random.default_rng(n)))
    ids, top = jax.jit(argmax)(x)
    np.testing.assert_array_equal(ids, jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(top, np.asarray(x)[np.arange(x.shape[0]), np.asarray(ids)])
    assert ids.dtype == jnp.int32
