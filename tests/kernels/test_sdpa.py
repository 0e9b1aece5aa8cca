"""The single-query (decode) path of `xla_attention` against a float64 numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_tx.kernels.sdpa import xla_attention


def _oracle(q, k, v, kv_lengths, q_offset, causal, scale):
    """Per row and head, in float64: softmax over the visible keys; zeros and -inf if none."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, _, H, K = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    o, lse = np.zeros((B, 1, H, K)), np.full((B, 1, H), -np.inf)
    for b in range(B):
        n = int(kv_lengths[b])
        if causal:
            n = min(n, int(q_offset[b]) + 1)
        if n == 0:
            continue
        for h in range(H):
            kv_head = h // (H // Hkv)
            s = k[b, :n, kv_head] @ q[b, 0, h] * scale
            lse[b, 0, h] = np.log(np.sum(np.exp(s - s.max()))) + s.max()
            o[b, 0, h] = np.exp(s - lse[b, 0, h]) @ v[b, :n, kv_head]
    return o, lse


@pytest.mark.parametrize("Hkv,G,K", [(1, 1, 16), (2, 3, 8), (4, 2, 16), (8, 2, 32)])
@pytest.mark.parametrize("causal", [True, False])
def test_single_query_against_float64(Hkv, G, K, causal):
    B, S = 4, 300
    kq, kk, kv = jax.random.split(jax.random.key(Hkv * 10 + G), 3)
    q = jax.random.normal(kq, (B, 1, Hkv * G, K))
    k = 3 * jax.random.normal(kk, (B, S, Hkv, K))  # peaked softmaxes as well as flat ones
    v = jax.random.normal(kv, (B, S, Hkv, K))
    kv_lengths = jnp.asarray([S, 1, 0, 173])
    q_offset = jnp.asarray([S - 1, 0, 0, 90])  # causal: the last row sees 91 of its 173 keys
    scale = 0.3
    o, lse = jax.jit(lambda q, k, v: xla_attention(q, k, v, kv_lengths=kv_lengths, q_offset=q_offset, causal=causal, scale=scale))(q, k, v)
    o_ref, lse_ref = _oracle(q, k, v, kv_lengths, q_offset, causal, scale)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))  # the empty row
    np.testing.assert_allclose(np.where(np.isinf(lse_ref), 0, lse), np.where(np.isinf(lse_ref), 0, lse_ref), atol=2e-5)
    # Other kv heads' blocks are multiplied by zero and then dropped: a huge value in
    # one head's keys and values changes no other head's output.
    k_big = k.at[:, :, 0].set(1e30) if Hkv > 1 else k
    v_big = v.at[:, :, 0].set(1e30) if Hkv > 1 else v
    o_big, _ = xla_attention(q, k_big, v_big, kv_lengths=kv_lengths, q_offset=q_offset, causal=causal, scale=scale)
    np.testing.assert_allclose(o_big[:, :, G:], o[:, :, G:], atol=1e-6)


def test_single_query_bf16_cache():
    """bf16 queries and cache: float32 scores and softmax, within bf16 rounding of float64."""
    B, S, Hkv, G, K = 2, 500, 2, 4, 64
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(kq, (B, 1, Hkv * G, K), jnp.bfloat16)
    k = jax.random.normal(kk, (B, S, Hkv, K), jnp.bfloat16)
    v = jax.random.normal(kv, (B, S, Hkv, K), jnp.bfloat16)
    kv_lengths, q_offset = jnp.asarray([S, 321]), jnp.asarray([S - 1, 320])
    o, lse = xla_attention(q, k, v, kv_lengths=kv_lengths, q_offset=q_offset)
    o_ref, lse_ref = _oracle(q, k, v, kv_lengths, q_offset, True, K**-0.5)
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(o.astype(jnp.float32), o_ref, atol=2e-2)
    np.testing.assert_allclose(lse, lse_ref, atol=2e-2)
