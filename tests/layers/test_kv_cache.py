"""int8 KV cache and shared-prefix sampling (n samples per prompt)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

import eqx_tx
from eqx_tx.analysis.memory import MemoryFigures, abstract_sharded_model, compile_sampling, target_mesh
from eqx_tx.infer.generation import generate, teacher_forced_logits
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.kernels.quantized import Quantized

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43], [38, 32, 79, 50, 28]]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=20),
                                    SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=5)])
@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_shared_prefix_equals_repeated_prompts(checkpoints, params, cache_dtype):
    model = eqx_tx.load(checkpoints["gqa4_bias"], progress=False)
    shared = generate(model, PROMPTS, params, n=4, cache_dtype=cache_dtype, prefill_chunk_size=4)
    plain = generate(model, PROMPTS, params, n=4, share_prefix=False, cache_dtype=cache_dtype)
    assert len(shared) == 12
    for a, b in zip(shared, plain):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    if params.temperature > 0:  # each of the n samples has its own stream
        assert len({tuple(r.tokens) for r in shared[:4]}) > 1
        assert shared[0].tokens == generate(model, PROMPTS[:1], params)[0].tokens  # sample 0 = plain n=1


def test_quantize_round_trip():
    x = jax.random.normal(jax.random.key(0), (3, 5, 2, 64)) * jnp.arange(1, 6)[None, :, None, None]
    q = Quantized.quantize(x)
    assert q.values.dtype == jnp.int8 and q.scale.shape == (3, 5, 2)
    err = jnp.abs(q.dequantize(jnp.float32) - x)
    assert float(jnp.max(err / q.scale[..., None])) <= 0.5 + 1e-6  # at most half a step
    assert float(jnp.abs(Quantized.quantize(jnp.zeros((2, 8))).dequantize(jnp.float32)).max()) == 0.0


def _kl(model, prompts, steps):
    greedy = generate(model, prompts, SamplingParams(max_new_tokens=steps, stop_token_ids=()))
    cont = [g.tokens for g in greedy]
    ref = jax.nn.log_softmax(teacher_forced_logits(model, prompts, cont), -1)
    q = jax.nn.log_softmax(teacher_forced_logits(model, prompts, cont, cache_dtype="int8", prefill_chunk_size=16), -1)
    return np.asarray(jnp.sum(jnp.exp(ref) * (ref - q), -1)), float(jnp.max(jnp.abs(ref - q)))


def test_int8_cache_quality_on_the_trained_model(trained_tiny):
    model = eqx_tx.load(trained_tiny, progress=False)
    tok = Tokenizer.from_file(f"{trained_tiny}/tokenizer.json")
    prompts = [tok.encode(t).ids for t in ["Once upon a time, there was a brave fox named Max.",
                                           "One day, Lily found a shiny key near the river.", "Every day"]]
    prompts = [p[:12] for p in prompts]
    kl, err = _kl(model, prompts, 40)
    assert kl.mean() <= 1e-5 and kl.max() <= 1e-3, (kl.mean(), kl.max())
    assert err < 0.2


@pytest.mark.parametrize("name", ["gqa4_bias", "llama3", "qwen3_moe"])
def test_int8_cache_quality_on_random_checkpoints(checkpoints, name):
    model = eqx_tx.load(checkpoints[name], progress=False)
    rng = np.random.default_rng(0)
    kl, _ = _kl(model, rng.integers(0, model.config.vocab_size, (4, 20)).tolist(), 24)
    assert kl.mean() <= 1e-5


def _cache_bytes(mem: MemoryFigures) -> int:
    return mem.argument  # params + cache + small decode state


def test_int8_cache_bytes_and_shared_prefix_savings():
    """From compiled memory analysis of the real decode function (abstract inputs)."""
    config = eqx_tx.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    mesh = target_mesh("cpu", tp=1)
    model = abstract_sharded_model(config, mesh, jnp.bfloat16)
    params = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(model))
    B, half = 64, 256

    def decode_args(**kw):
        compiled = compile_sampling(model, mesh, B, half, half, compute=eqx_tx.ComputeConfig(), **kw)
        return MemoryFigures.of(compiled["decode"]).argument - params

    bf16 = decode_args(cache_dtype=jnp.bfloat16)
    int8 = decode_args(cache_dtype=jnp.int8)
    expected_bf16 = 2 * 4 * B * 2 * half * 2 * 128 * 2  # k+v, layers, batch, heads, tokens, head_dim, bytes
    assert bf16 == pytest.approx(expected_bf16, rel=0.02)
    assert int8 <= 0.55 * bf16
    shared = decode_args(cache_dtype=jnp.bfloat16, n=8)
    assert shared == pytest.approx(bf16 * (1 - 7 / 16), rel=0.03)  # prompt stored once instead of 8 times: -44%


def test_bad_n(checkpoints):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    with pytest.raises(ValueError, match="n must be a positive int"):
        generate(model, PROMPTS, n=0)
