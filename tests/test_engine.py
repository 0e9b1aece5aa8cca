"""The continuous-batching engine over a paged KV cache: every request equals
`generate` on that request alone, whatever runs beside it and whenever it arrives."""

import collections

import equinox as eqx
import jax
import numpy as np
import pytest

import eqx_tx
from eqx_tx.infer.config import EngineConfig
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.infer.steps import paged_decode_step
from tests.lora_util import perturbed_adapters


def _workload(vocab: int, seed: int):
    """Ragged prompts with long-tailed output lengths; greedy and seeded top-k/top-p
    requests mixed; a stop token that some sampled requests hit early."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(9):
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        max_new = int(min(3 + rng.geometric(0.15), 30))
        if i % 3 == 0:
            params = SamplingParams(max_new_tokens=max_new)
        else:
            params = SamplingParams(max_new_tokens=max_new, temperature=0.9, top_k=[0, 20][i % 2], top_p=0.9,
                                    seed=100 + i, stop_token_ids=(3, 5))
        requests.append((prompt, params))
    return requests


def _assert_equal_to_generate(model, requests, results, cache_dtype=None):
    """Against one `generate` call over all requests: its results do not depend on
    the batch (`test_generation.py::test_sampling_is_deterministic_and_batch_independent`),
    so this is `generate` on each request alone, at one compile."""
    prompts, params = zip(*requests)
    for (prompt, sp), got, want in zip(requests, results, eqx_tx.generate(model, prompts, params, cache_dtype=cache_dtype)):
        assert got.tokens == want.tokens and got.stop_reason == want.stop_reason, (prompt, sp)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_arriving_while_others_run_equal_generate_alone(checkpoints, overlap):
    """Three slots, a pool that cannot hold every request at once (requests wait for
    pages), prompts longer than a prefill chunk, requests added mid-run; each equals
    `generate` alone, the decode step compiles once, and the pool ends empty; the same
    with each step launched before the one before it is recorded (`overlap_steps`:
    a request that stops has its next row dropped, and streams no token after its last)."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    requests = _workload(model.config.vocab_size, seed=0)
    engine = eqx_tx.Engine(model, max_seqs=3, max_tokens_in_cache=96, page_size=8, prefill_chunk=16,
                           overlap_steps=overlap)
    compiled = paged_decode_step._cache_size()
    ids = [engine.add(*r) for r in requests[:4]]
    streamed: dict[int, list[int]] = {}
    steps, peak_pages = 0, 0
    while engine.has_work() or len(ids) < len(requests):
        if steps % 5 == 4 and len(ids) < len(requests):
            ids.append(engine.add(*requests[len(ids)]))
        for event in engine.step():
            streamed.setdefault(event.request_id, []).append(event.token)
        peak_pages = max(peak_pages, engine.pages_in_use)
        steps += 1
    results = [engine.result(i) for i in ids]
    assert [streamed[i] for i in ids] == [r.tokens for r in results]
    assert engine.pages_in_use == 0 and peak_pages <= engine.num_pages
    assert engine.stats()["preemptions"] > 0  # the pool ran out: the newest went back to wait, then on
    assert len({r.stop_reason for r in results}) == 2  # some stop early, some run to their length
    # Shapes are fixed but for the running slots padded to a power of two: one compile per row count (1, 2, 3;
    # the second parameter finds them compiled).
    assert paged_decode_step._cache_size() - compiled <= 3
    _assert_equal_to_generate(model, requests, results)


def test_smallest_shapes_pad_short_chunks_and_few_rows_and_change_no_result(checkpoints):
    """`min_prefill_chunk` and `min_decode_rows` (an accelerator's defaults are 128 and
    8; on CPU 16 and 1): every prefill remainder runs in a chunk of at least that many
    positions and every decode step in at least that many rows, which are all the
    shapes `step_shapes` (and so `warmup`) lists; each result equals `generate` alone."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    defaults = eqx_tx.Engine(model, max_seqs=4, max_tokens_in_cache=160, page_size=8)
    assert (defaults.scheduler.min_chunk, defaults.scheduler.min_rows) == (16, 1)  # on CPU
    requests = _workload(model.config.vocab_size, seed=1)[:5]
    engine = eqx_tx.Engine(model, max_seqs=4, max_tokens_in_cache=160, page_size=8, prefill_chunk=32,
                           min_prefill_chunk=32, min_decode_rows=4)
    prefill_shapes, decode_rows = engine.scheduler.step_shapes()
    assert {C for C, _ in prefill_shapes} == {32} and decode_rows == [4]
    plans, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    results = engine.run(requests)
    assert {p.prefill.tokens.shape[1] for p in plans if p.prefill is not None} == {32}
    assert {len(p.decode.rows) for p in plans if p.decode is not None} == {4}
    assert min(len(r) for r, _ in requests) < 32 and min(len(p.decode.requests) for p in plans if p.decode) < 4
    _assert_equal_to_generate(model, requests, results)
    with pytest.raises(ValueError, match="min_decode_rows must be a power of two, got 3"):
        eqx_tx.EngineConfig(min_decode_rows=3)
    # Runs of rows sharing a prompt's pages: by default on a TPU alone, as many rows as fit their query heads
    # in the kernel's 128-row tile (Qwen3-0.6B's 16 heads: 8; 32 heads over tp=8: 32; 96: 1, which is no run).
    auto, eight = EngineConfig(), EngineConfig(shared_decode_rows=8)
    assert [auto.decode_run_rows("tpu", h) for h in (16, 32, 4, 12, 96)] == [8, 4, 32, 8, 0]
    assert auto.decode_run_rows("gpu", 16) == auto.decode_run_rows("cpu", 16) == defaults.share_rows == 0
    assert eight.decode_run_rows("cpu", 16) == 8 and EngineConfig(shared_decode_rows=0).decode_run_rows("tpu", 16) == 0


def test_tp_int8_engine_equals_generate(checkpoints):
    """An int8 pool on a tp=2 mesh (kv heads split like the model's, their scales in one
    group per device: `eqx_tx.kernels.quantized`), short of pages."""
    mesh = eqx_tx.make_mesh(dp=1, tp=2, devices=jax.devices()[:2])
    model = eqx_tx.load(checkpoints["gqa4_bias"], mesh=mesh, progress=False)
    requests = _workload(model.config.vocab_size, seed=1)[:5]
    engine = eqx_tx.Engine(model, max_seqs=3, max_tokens_in_cache=96, page_size=16, prefill_chunk=32,
                           cache_dtype="int8")
    cache = engine.runner.cache
    assert cache.k.dtype == jax.numpy.int8 and cache.k.sharding.spec[3] == "tp"
    assert cache.k_scale.shape[2] == 2 and cache.k_scale.sharding.spec[2] == "tp"  # [layers, pages, groups, ...]
    _assert_equal_to_generate(model, requests, engine.run(requests), cache_dtype="int8")


def test_requests_that_can_never_fit_are_refused(checkpoints):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    engine = eqx_tx.Engine(model, max_seqs=2, max_tokens_in_cache=64, page_size=8)
    with pytest.raises(ValueError, match="60 prompt \\+ 10 new tokens = 70, more than the engine's max_seq_len 64"):
        engine.add(list(range(60)), SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        engine.add([1, 2, 1000])
    with pytest.raises(ValueError, match="holds no page"):
        eqx_tx.Engine(model, max_seqs=2, max_tokens_in_cache=4, page_size=8)
    assert not engine.has_work()


def test_cached_prefix_pages_are_shared_and_exact(checkpoints):
    """A 24-token system prompt (3 pages of 8) before each request is computed once:
    later requests start after it (and `n` samples of one prompt share its pages),
    and every result still equals `generate` alone (samples as `generate(..., n=3)`)."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    rng = np.random.default_rng(3)
    system = rng.integers(0, model.config.vocab_size, size=24).tolist()
    prompts = [system + rng.integers(0, model.config.vocab_size, size=k).tolist() for k in (1, 4, 9, 2)]
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=9, temperature=0.8, seed=7)] * 2
    engine = eqx_tx.Engine(model, max_seqs=4, max_tokens_in_cache=160, page_size=8, prefill_chunk=16)
    ids = [engine.add(p, sp) for p, sp in zip(prompts, params)]
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=11)
    ids += [engine.add(prompts[2], sampled, sample=j) for j in range(3)]
    counts = []
    while engine.has_work():
        engine.step()
        stats = engine.stats()
        counts.append((stats["running"], stats["tokens_held"], stats["tokens_read"]))
    results = [engine.result(i) for i in ids]
    _assert_equal_to_generate(model, list(zip(prompts, params)), results[:4])
    # Shared pages are held once and read once per request: while several requests share
    # the system prompt's 3 full pages, the pool holds at least 24 tokens fewer than
    # decoding reads; one request alone holds what it reads.
    assert all(held <= read for _, held, read in counts)
    assert max(read - held for _, held, read in counts) >= 24, counts
    assert all(held == read for running, held, read in counts if running == 1), counts
    for got, want in zip(results[4:], eqx_tx.generate(model, [prompts[2]], sampled, n=3)):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    stats = engine.stats()
    # The first request computes the system prompt; the next three reuse its 3 pages; the
    # samples reuse prompts[2]'s first 4 full pages (33 tokens: the last is always computed).
    assert stats["cached_tokens"] == 3 * 24 + 3 * 32, stats
    assert stats["pages_in_use"] == 0 and stats["pages_cached"] > 0


def test_prompt_scores_come_out_of_the_prefill_after_the_cached_prefix(checkpoints):
    """A request that asks for its prompt's last `n` tokens scored (log-probs and top-k)
    gets what `prompt_scores` (a forward pass, checked against HF elsewhere) gives,
    computing only from the last cached page before them: a 40-token prompt sampled
    first leaves 4 full pages of 8 cached; scoring its last 5 tokens reuses 4 pages,
    its last 12 reuses 3 (positions 27-38 are scored), all of them none. Another
    request running beside them is untouched (equal to `generate`)."""
    from eqx_tx.infer.prompt_scores import prompt_scores

    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, model.config.vocab_size, size=40).tolist()
    engine = eqx_tx.Engine(model, max_seqs=3, max_tokens_in_cache=256, page_size=8, prefill_chunk=16)
    first = engine.run([(prompt, SamplingParams(max_new_tokens=3))])[0]
    assert first.prompt_scores is None
    for n, k, cached in ((5, 3, 32), (12, 0, 24), (39, 2, 0)):
        before = engine.stats()["cached_tokens"]
        other = (rng.integers(0, model.config.vocab_size, size=13).tolist(), SamplingParams(max_new_tokens=7))
        ids = [engine.add(prompt, SamplingParams(max_new_tokens=3), score_last_n=n, score_top_k=k),
               engine.add(*other)]
        while engine.has_work():
            engine.step()
        got, beside = engine.result(ids[0]), engine.result(ids[1])
        assert engine.stats()["cached_tokens"] - before == cached, n
        want = prompt_scores(model, prompt, last_n=n, top_k=k)
        np.testing.assert_allclose(got.prompt_scores.logprobs, want[0], atol=1e-5)
        assert got.prompt_scores.top_ids.shape == (n, k)
        np.testing.assert_array_equal(got.prompt_scores.top_ids, want[1])
        np.testing.assert_allclose(got.prompt_scores.top_logprobs, want[2], atol=1e-5)
        assert got.tokens == first.tokens
        _assert_equal_to_generate(model, [other], [beside])
    with pytest.raises(ValueError, match="can score 1 to 39 tokens of a 40-token prompt"):
        engine.add(prompt, score_last_n=40)


def _bank(model, adapters: int):
    """`model` with a bank of `adapters` LoRA adapters that all differ (B randomised)."""
    bank = eqx_tx.apply_lora(model, rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "down_proj"),
                             adapters=adapters, key=jax.random.key(1))
    return perturbed_adapters(bank, jax.random.key(2))


def test_requests_with_different_adapters_of_a_bank(checkpoints):
    """Requests naming different LoRA adapters of a bank run in one batch, each equal
    to `generate` with its adapter; a shared system prompt's pages are shared only
    between requests of the same adapter (the adapter changes its keys/values)."""
    bank = _bank(eqx_tx.load(checkpoints["gqa_untied"], progress=False), adapters=3)
    rng = np.random.default_rng(4)
    system = rng.integers(0, bank.config.vocab_size, size=16).tolist()
    prompts = [system + rng.integers(0, bank.config.vocab_size, size=k).tolist() for k in (3, 5, 2, 7, 4)]
    adapters = [2, 0, 2, 1, 0]
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=5, temperature=0.9, top_k=20, seed=3)] * 2
    params.append(SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9, seed=5))
    engine = eqx_tx.Engine(bank, max_seqs=3, max_tokens_in_cache=128, page_size=8, prefill_chunk=16)
    results = engine.run(zip(prompts, params), adapters=adapters)
    for got, want in zip(results, eqx_tx.generate(bank, prompts, params, adapters=adapters)):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    # Two pages of system prompt per request: adapters 2 and 0 reuse them once each, adapter 1 never.
    assert engine.stats()["cached_tokens"] == 2 * 16, engine.stats()
    with pytest.raises(ValueError, match="adapter must name each sequence"):
        engine.add(prompts[0])
    with pytest.raises(ValueError, match=r"adapter must lie in \[0, 3\)"):
        engine.add(prompts[0], adapter=3)


def test_mixed_steps_run_prefill_and_decode_in_one_pass_and_change_no_result(checkpoints):
    """Requests of different adapters of a bank arriving while others decode: with
    mixed steps each step that prefills while requests run is one pass
    through the model (`paged_mixed_step`: the chunk's tokens and the decode rows laid
    out as one row, attention and adapters per group), with real rows in both groups;
    every result equals the engine's separate passes and `generate` alone, in the pool's
    dtype. Fewer passes run than with separate prefill and decode passes."""
    bank = _bank(eqx_tx.load(checkpoints["gqa_untied"], progress=False), adapters=3)
    requests = _workload(bank.config.vocab_size, seed=6)[:7]
    adapters = [2, 0, 1, 1, 0, 2, 0]
    passes = {}
    for mixed in (True, False):
        engine = eqx_tx.Engine(bank, max_seqs=3, max_tokens_in_cache=192, page_size=8, prefill_chunk=16,
                               mixed_steps=mixed, cache_dtype="int8")
        runner, counts = engine.runner, collections.Counter()
        for name in ("prefill", "decode", "mixed"):
            def counted(*batches, _run=getattr(runner, name), _name=name):
                counts[_name] += 1
                if _name == "mixed":
                    counts["mixed_with_both"] += len(batches[1].requests) > 0 and len(batches[0].requests) > 0
                return _run(*batches)
            setattr(runner, name, counted)
        ids = [engine.add(*r, adapter=a) for r, a in zip(requests[:2], adapters)]
        while engine.has_work() or len(ids) < len(requests):
            if len(ids) < len(requests) and engine.has_work():
                ids.append(engine.add(*requests[len(ids)], adapter=adapters[len(ids)]))
            engine.step()
        results = [engine.result(i) for i in ids]
        passes[mixed] = counts
        if mixed:
            assert counts["prefill"] == 0 and counts["mixed_with_both"] >= 3, counts
            mixed_results = results
        else:
            assert counts["mixed"] == 0, counts
            for got, want in zip(mixed_results, results):
                assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
                np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    def total(c):
        return c["prefill"] + c["decode"] + c["mixed"]

    assert total(passes[True]) < total(passes[False]), passes
    prompts, params = zip(*requests)
    for got, want in zip(mixed_results, eqx_tx.generate(bank, prompts, params, adapters=adapters, cache_dtype="int8")):
        assert got.tokens == want.tokens, got
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


def test_set_model_samples_from_new_weights(checkpoints):
    """After `set_model` (e.g. a training step) the engine samples from the new weights,
    without reusing pages computed by the old ones; it refuses a busy engine or a model
    of another shape."""
    model = eqx_tx.load(checkpoints["gqa_untied"], progress=False)
    prompt, params = list(range(1, 20)), SamplingParams(max_new_tokens=5)
    engine = eqx_tx.Engine(model, max_seqs=2, max_tokens_in_cache=64, page_size=8, prefill_chunk=16)
    engine.run([(prompt, params)])
    new = jax.tree.map(lambda x: x * 1.5 if eqx.is_inexact_array(x) and x.ndim == 3 else x, model)
    engine.set_model(new)
    [got] = engine.run([(prompt, params)])
    [want] = eqx_tx.generate(new, [prompt], params)
    assert got.tokens == want.tokens and engine.stats()["cached_tokens"] == 0
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="structure and shapes"):
        engine.set_model(eqx_tx.load(checkpoints["mha_tied"], progress=False))
    engine.add(prompt, params)
    with pytest.raises(ValueError, match="while requests are waiting or running"):
        engine.set_model(model)


@pytest.mark.parametrize("adapters", [None, 3])
@pytest.mark.parametrize("mixed", [True, False])
def test_compiled_engine_steps_read_the_weights_the_pool_and_little_else(adapters, mixed):
    """`eqx_tx.analysis.memory.compile_engine_step` (what `benchmark_memory.py --mode engine`
    measures) compiles the engine's own steps (mixed or separate prefill, and decode),
    with and without a LoRA bank: their arguments are the weights, the page pool and
    small per-row arrays, and the pool is written in place, never copied (a mixed
    step's two groups of rows write it in one scatter)."""
    from eqx_tx.analysis.memory import MemoryFigures, abstract_sharded_model, compile_engine_step, target_mesh

    config = eqx_tx.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    mesh = target_mesh("cpu", tp=1)
    model = abstract_sharded_model(config, mesh, jax.numpy.bfloat16, lora_rank=4 if adapters else 0,
                                   lora_adapters=adapters)
    params = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(model))
    S, pool_tokens = 8, 1024
    engine = EngineConfig(max_seqs=S, max_tokens_in_cache=pool_tokens, max_seq_len=256, prefill_chunk=64,
                          mixed_steps=mixed)
    compiled = compile_engine_step(model, mesh, engine, compute=eqx_tx.ComputeConfig())
    assert set(compiled) == {"mixed" if mixed else "prefill", "decode"}
    pool = 2 * 2 * pool_tokens * 2 * 32 * 2  # k+v, layers, tokens, kv heads, head_dim, bf16 bytes
    logits = S * config.vocab_size * 4
    pool_shape = "[2,64,16,2,32]"  # layers, pages, page size, kv heads, head_dim (any dtype)
    for name, step in compiled.items():
        extra = MemoryFigures.of(step).argument - params - pool
        assert logits <= extra <= logits + 32 * 1024, (name, extra)
        text = step.as_text()
        assert pool_shape in text and not [line for line in text.splitlines() if pool_shape in line
                                           and " copy(" in line], name
