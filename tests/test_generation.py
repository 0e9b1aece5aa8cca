"""Generation: HF parity, chunked prefill, sampling statistics, memory, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_tx
from eqx_tx.cache.allocate import new_cache
from eqx_tx.core.hlo import materialized
from eqx_tx.core.log import compile_times
from eqx_tx.infer import generation
from eqx_tx.infer.generation import DecodeState, decode, generate, prefill
from eqx_tx.infer.sampling import SamplerArrays, SamplingParams, sample_token
from eqx_tx.io.loading import abstract_model
from tests.hf_utils import hf_model

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43], [38, 32, 79, 50, 28]]
NEW = 33


def _hf_greedy(hf, prompt, n):
    out = hf.generate(torch.as_tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    toks = out.sequences[0, len(prompt):].tolist()
    logps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, toks)]
    return toks, logps


# On CPU, decoding more than one row runs the layers unrolled (`decode_layers="auto"`);
# "scan" is what other platforms run.
@pytest.mark.parametrize("attention, decode_layers", [("xla", "auto"), ("blockwise", "auto"), ("xla", "scan")])
def test_greedy_equals_hf_generate_ragged(checkpoint, attention, decode_layers):
    _, path = checkpoint
    model = eqx_tx.load(path, progress=False)
    compute = eqx_tx.ComputeConfig(attention=attention, block_q=8, block_kv=8, decode_layers=decode_layers)
    results = generate(model, PROMPTS, SamplingParams(max_new_tokens=NEW), compute=compute)
    hf = hf_model(path)
    for prompt, r in zip(PROMPTS, results):
        toks, logps = _hf_greedy(hf, prompt, NEW)
        assert r.tokens == toks
        np.testing.assert_allclose(r.logprobs, logps, atol=1e-4)
        assert r.stop_reason == "length"


@pytest.mark.parametrize("chunk", [1, 4, 5, 11, 64])
def test_chunked_prefill_gives_the_same_tokens(checkpoints, chunk):
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    params = SamplingParams(max_new_tokens=12)
    ref = generate(model, PROMPTS, params)
    out = generate(model, PROMPTS, params, prefill_chunk_size=chunk)
    for a, b in zip(ref, out):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_second_call_compiles_nothing(checkpoints):
    """Calling `generate` again with the same shapes reuses every compiled program
    (the cache allocation was compiled again on every call: ~60 ms of a TPU's time
    to first token)."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False, dtype=jnp.bfloat16)  # shapes no other test compiles
    params = SamplingParams(max_new_tokens=3)
    with compile_times() as compiles:
        first = generate(model, PROMPTS, params)
        n_first = len(compiles)
        again = generate(model, PROMPTS, params)
    assert n_first > 0  # the listener sees compilations
    assert len(compiles) == n_first
    assert [r.tokens for r in again] == [r.tokens for r in first]


def test_stop_tokens_and_per_request_lengths(checkpoints):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    free = generate(model, PROMPTS[:1], SamplingParams(max_new_tokens=10))[0]
    stop = free.tokens[4]
    first = free.tokens.index(stop)
    params = [SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)), SamplingParams(max_new_tokens=3)]
    a, b = generate(model, [PROMPTS[0], PROMPTS[1]], params)
    assert a.tokens == free.tokens[: first + 1] and a.stop_reason == "stop"
    assert len(b.tokens) == 3 and b.stop_reason == "length"


def test_sampling_is_deterministic_and_batch_independent(checkpoints):
    model = eqx_tx.load(checkpoints["gqa4_bias"], progress=False)
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=s) for s in (7, 8, 9)]
    batch = generate(model, PROMPTS, params)
    again = generate(model, PROMPTS, params)
    assert [r.tokens for r in batch] == [r.tokens for r in again]
    alone = generate(model, [PROMPTS[1]], params[1])[0]
    assert alone.tokens == batch[1].tokens
    np.testing.assert_allclose(alone.logprobs, batch[1].logprobs, atol=1e-5)
    other_seed = generate(model, [PROMPTS[1]], SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert other_seed[0].tokens != alone.tokens
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=16))
    top1 = generate(model, PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1, seed=3))
    assert [r.tokens for r in greedy] == [r.tokens for r in top1]


def _reference_distribution(logits, temperature, top_k, top_p):
    """Hugging Face's order: temperature, top-k, top-p; renormalised (numpy)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[: top_k or len(p)]] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    cum = np.cumsum(q[order]) - q[order]
    keep2 = np.zeros_like(p, bool)
    keep2[order[cum < top_p]] = True
    q = np.where(keep2, q, 0)
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.5, 4, 1.0), (1.0, 5, 0.6)])
def test_sampling_matches_reference_distribution(temperature, top_k, top_p):
    logits = jnp.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 40_000
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.jit(jax.vmap(lambda k: sample_token(logits, jnp.float32(temperature), jnp.int32(top_k),
                                                    jnp.float32(top_p), k)))(keys)
    freq = np.bincount(np.asarray(draws), minlength=8) / n
    expected = _reference_distribution(np.asarray(logits, np.float64), temperature, top_k, top_p)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), (freq, expected)
    assert np.all(freq[expected == 0] == 0)


def test_tp_generation_equals_single_device(checkpoints):
    path = checkpoints["gqa4_bias"]
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=1)
    ref = generate(eqx_tx.load(path, progress=False), PROMPTS, params)
    mesh = eqx_tx.make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    out = generate(eqx_tx.load(path, mesh=mesh, progress=False), PROMPTS, params)
    for a, b in zip(ref, out):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _config(vocab=32768):
    return eqx_tx.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _abstract_cache(config, B, L):
    return new_cache(config, B, L, jnp.float32, abstract=True)


def test_prefill_never_holds_full_logits():
    config = _config()
    model = abstract_model(config, jnp.float32)
    B, T = 4, 1024
    S = jax.ShapeDtypeStruct
    compiled = prefill.lower(model, _abstract_cache(config, B, T), S((B, T), jnp.int32), S((B,), jnp.int32),
                             chunk=T, compute=eqx_tx.ComputeConfig()).compile()
    logits_bytes = B * T * config.vocab_size * 4
    assert compiled.memory_analysis().temp_size_in_bytes < logits_bytes / 8


def test_decode_memory_is_the_cache_updated_in_place():
    config = _config()
    model = abstract_model(config, jnp.float32)
    S = jax.ShapeDtypeStruct
    V, L = config.vocab_size, config.num_hidden_layers
    for B, T in [(4, 1024), (4, 4096), (16, 4096)]:
        cache = _abstract_cache(config, B, T)
        cache_bytes = 2 * np.prod(cache.k.shape) * 4
        state = DecodeState(cache, S((B, V), jnp.float32), S((B,), jnp.int32), S((B,), jnp.int32), S((B,), jnp.int32),
                            S((B, 64), jnp.int32), S((B, 64), jnp.float32), S((), jnp.int32))
        sampler = SamplerArrays.from_params([SamplingParams()] * B, (), V)
        scan = eqx_tx.ComputeConfig(decode_layers="scan")  # as on GPU; on CPU, auto adds a copy of the weights
        mem = decode.lower(model, state, sampler, S((), jnp.int32), compute=scan).compile().memory_analysis()
        # The whole decode state, cache included, is updated in place (donated and aliased) ...
        assert mem.alias_size_in_bytes >= cache_bytes
        # ... and the only cache-dependent scratch is one layer's keys/values, not a second cache.
        assert mem.temp_size_in_bytes <= cache_bytes / L + 8 * B * V * 4, (B, T, mem.temp_size_in_bytes)
    # Unrolled (CPU's choice at batch > 1): the same, plus one copy of the layer weights.
    unrolled = eqx_tx.ComputeConfig(decode_layers="unrolled")
    more = decode.lower(model, state, sampler, S((), jnp.int32), compute=unrolled).compile().memory_analysis()
    layer_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(model.model.layers))
    assert more.alias_size_in_bytes >= cache_bytes
    assert more.temp_size_in_bytes <= cache_bytes / L + 8 * B * V * 4 + layer_bytes, more.temp_size_in_bytes


def _compiled_decode(B: int, compute: eqx_tx.ComputeConfig):
    """The compiled decode loop at batch `B` (top-k/top-p sampling), the name of its
    entry computation, the element counts of the layer weights (the vocabulary, 4000,
    matches none of them) and the shape of the stacked cache's keys."""
    config = eqx_tx.Qwen3Config(vocab_size=4000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = abstract_model(config, jnp.float32)
    S = jax.ShapeDtypeStruct
    T, V = 192, config.vocab_size
    cache = _abstract_cache(config, B, T)
    state = DecodeState(cache, S((B, V), jnp.float32), S((B,), jnp.int32), S((B,), jnp.int32),
                        S((B,), jnp.int32), S((B, 64), jnp.int32), S((B, 64), jnp.float32), S((), jnp.int32))
    sampler = SamplerArrays.from_params([SamplingParams(temperature=0.7, top_k=20, top_p=0.95)] * B, (), V)
    text = decode.lower(model, state, sampler, S((), jnp.int32), compute=compute).compile().as_text()
    weight_sizes = {int(np.prod(a.shape[1:])) for a in jax.tree.leaves(model.model.layers) if a.ndim >= 3}
    assert weight_sizes >= {256 * 256, 128 * 256, 768 * 256}
    entry = re.search(r"^ENTRY %([\w.\-]+) ", text, re.M).group(1)
    return materialized(text), entry, weight_sizes, tuple(cache.k.shape)


@pytest.mark.parametrize("B", [1, 16])
def test_decode_step_copies_neither_weights_nor_cache(B):
    """The compiled decode loop on CPU (`decode_layers="auto"`) copies no layer weight
    and no KV cache on any step. Batch 1 (scanned stack): each projection is a
    matrix-vector product fused with the read of its layer's slice of the stacked
    weights, so no weight is copied at all. Batch 16 (unrolled): each layer weight is
    sliced out of the stack once, before the token loop. The cache is written in
    place at both (at batch 1 only thanks to `KVCache.write`'s second, dropped
    update: four copies of the whole cache per layer without it)."""
    L = 4
    buffers, entry, weight_sizes, cache_shape = _compiled_decode(B, eqx_tx.ComputeConfig())
    assert any(b.op == "fusion" for b in buffers)  # the parser sees the step's kernels
    weights = [b for b in buffers if int(np.prod(b.shape)) in weight_sizes]
    assert [b for b in weights if b.computation != entry] == []
    assert len(weights) == (0 if B == 1 else L * 7), weights  # layers x (q, k, v, o, gate, up, down)
    assert [b for b in buffers if b.shape == cache_shape and b.op == "copy"] == []


def test_scanned_batched_decode_copies_every_layer_weight_on_every_step():
    """Why CPU unrolls at batch > 1: with the stack scanned (`"scan"`, as on GPU),
    XLA:CPU copies every layer's weights inside the loop, on every step (its matmul
    of more than one row wants its weight in a buffer of its own). (The same check as
    above, seeing the copies when they are there.)"""
    buffers, entry, weight_sizes, _ = _compiled_decode(16, eqx_tx.ComputeConfig(decode_layers="scan"))
    in_loop = [b for b in buffers if b.computation != entry and int(np.prod(b.shape)) in weight_sizes]
    assert len(in_loop) >= 7, in_loop


@pytest.mark.parametrize("platform, batch, unrolled", [("cpu", 1, False), ("cpu", 16, True), ("tpu", 1, True),
                                                       ("tpu", 16, True), ("gpu", 1, False), ("gpu", 16, False)])
def test_decode_layers_auto_per_platform(monkeypatch, platform, batch, unrolled):
    """`decode_layers="auto"` unrolls where a scanned step was measured slower (CPU at
    batch > 1, TPU; `ComputeConfig.decode_layers`) and scans elsewhere; explicit
    settings are kept as asked on every platform."""
    config = eqx_tx.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = eqx_tx.init_model(config, key=jax.random.key(0))
    monkeypatch.setattr(generation, "target_platform", lambda mesh: platform)
    layers = generation._decode_layers(model, eqx_tx.ComputeConfig(), batch).model.layers
    assert isinstance(layers, tuple) == unrolled
    if unrolled:
        assert len(layers) == 3 and layers[0].mlp.gate_proj.weight.shape == (64, 32)
    for choice, tuple_ in (("scan", False), ("unrolled", True)):
        layers = generation._decode_layers(model, eqx_tx.ComputeConfig(decode_layers=choice), batch).model.layers
        assert isinstance(layers, tuple) == tuple_


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([[]], SamplingParams(), "prompt 0 is empty"),
        ([], SamplingParams(), "no prompts"),
        ([[1] * 40000], SamplingParams(), "more than max_position_embeddings 32768"),
        ([[1, 2]], SamplingParams(max_new_tokens=32767), "exceeds max_position_embeddings 32768"),
        ([[1, 2, 500]], SamplingParams(), r"token ids outside \[0, 97\)"),
        ([[1], [2]], [SamplingParams()], "1 sampling params for 2 prompts"),
        ([[1]], SamplingParams(stop_token_ids=(97,)), "stop token id 97 is outside the vocabulary"),
    ],
)
def test_bad_generation_input(checkpoints, prompts, params, message):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_k=-2), "top_k must be an int >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_streamed_generate_compiles_its_decode_loop_once(checkpoints):
    """The decode loop runs in segments when streaming; the state it returns is
    committed to its devices, and so is the first one (an uncommitted first state made
    every streamed call compile the loop twice)."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False, dtype=jnp.bfloat16)
    before = generation.decode._cache_size()
    segments = []
    results = generate(model, PROMPTS, SamplingParams(max_new_tokens=9, stop_token_ids=()), stream_every=2,
                       on_tokens=segments.append)
    assert len(segments) >= 4 and all(len(r.tokens) == 9 for r in results)
    assert generation.decode._cache_size() - before == 1


def test_prompts_in_one_length_bucket_share_their_programs(checkpoints):
    """Prompts and caches are padded to length buckets (four per octave): calls whose
    longest prompts are 161, 170 and 185 tokens (all padded to 192, and with 4 new
    tokens their caches to 192 slots; in multiples of 16 they were 176 and 192) run one
    compiled prefill and one decode loop, and the tokens are those of each prompt
    generated alone (padding changes nothing)."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    rng = np.random.default_rng(4)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    prefill_before, decode_before = prefill._cache_size(), decode._cache_size()
    calls = [[rng.integers(0, model.config.vocab_size, n).tolist(), [5, 6, 7]] for n in (161, 170, 185)]
    batched = [generate(model, prompts, params) for prompts in calls]
    assert (prefill._cache_size() - prefill_before, decode._cache_size() - decode_before) == (1, 1)
    for prompts, results in zip(calls, batched):
        for prompt, got in zip(prompts, results):
            assert got.tokens == generate(model, [prompt], params)[0].tokens
