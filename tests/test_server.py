"""tools/serve.py with the official `openai` client: completions and chat, streaming
and not, concurrent requests equal to `generate`, stop strings, 4xx answers that
leave the server working, a client leaving mid-stream (its pages are freed), and a
LoRA adapter served beside the base model."""

import concurrent.futures
import dataclasses
import functools
import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import pytest

import eqx_tx
from eqx_tx.core.log import compile_times
from eqx_tx.infer.config import EngineConfig
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.serve.tinker_config import TinkerConfig
from tests.lora_util import perturbed_adapters
from tests.tools_util import ROOT, Loopback, load_tool


@dataclasses.dataclass
class Served:
    client: openai.OpenAI
    loop: object
    tokenizer: object
    base: object  # the model served as "tiny"
    tuned: object  # the base with the LoRA adapter served as "tiny-lora"


@pytest.fixture(scope="module")
def served(trained_tiny, tmp_path_factory):
    """A server on the trained tiny model with a chat template ("tiny") and a LoRA
    adapter of it ("tiny-lora"): both go through one adapter bank."""
    directory = tmp_path_factory.mktemp("served") / "tiny"
    shutil.copytree(trained_tiny, directory)
    shutil.copy(f"{ROOT}/tests/fixtures/chat_templates/qwen3.jinja", directory / "chat_template.jinja")
    base = eqx_tx.load(directory, progress=False)
    tuned = eqx_tx.apply_lora(base, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"),
                              key=jax.random.key(0))
    tuned = perturbed_adapters(tuned, jax.random.key(1))
    adapter_dir = directory.parent / "adapter"
    eqx_tx.save_adapter(tuned, adapter_dir)
    serve = load_tool("serve")
    engine = EngineConfig(max_seqs=4, max_tokens_in_cache=2048, page_size=16, prefill_chunk=32, max_top_logprobs=5)
    loop, app = serve.build(serve.Args(model=str(directory), engine=engine, lora=(f"tiny-lora={adapter_dir}",)))
    server = Loopback(app)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=120)
    yield Served(client, loop, eqx_tx.load_tokenizer(directory), base, tuned)
    server.stop()
    loop.stop()


def _idle(loop) -> tuple[bool, int]:
    return loop.call(lambda engine: (engine.has_work(), engine.pages_in_use))


def test_completions_stream_and_not_equal_generate_under_concurrency(served):
    client, loop, tokenizer, model = served.client, served.loop, served.tokenizer, served.base
    prompts = ["Once upon a time", "The cat", "A little girl named Lily", "One day, a big"]
    seeds = [1, 2, 3, 4]

    def ask(i: int):
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0.8, top_p=0.9,
                                         seed=seeds[i], logprobs=1, extra_body={"top_k": 20})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=s) for s in seeds]
    expected = eqx_tx.generate(model, [tokenizer.encode(p) for p in prompts], params)
    for answer, want in zip(answers, expected):
        [choice] = answer.choices
        assert choice.text == tokenizer.decode(want.tokens)
        assert choice.finish_reason == want.stop_reason
        np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs, rtol=1e-4, atol=1e-5)
    assert answers[0].usage.prompt_tokens == len(tokenizer.encode(prompts[0]))

    stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0.8, top_p=0.9,
                                       seed=seeds[0], stream=True, extra_body={"top_k": 20})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == answers[0].choices[0].text
    assert chunks[-1].choices[0].finish_reason == answers[0].choices[0].finish_reason
    assert _idle(loop) == (False, 0)


def test_chat_with_n_samples_and_stop_strings(served):
    client, tokenizer = served.client, served.tokenizer
    messages = [{"role": "user", "content": "Tell me a story."}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=1.0, n=3,
                                            seed=5, logprobs=True)
    assert len(answer.choices) == 3 and len({c.message.content for c in answer.choices}) > 1
    prompt = tokenizer.encode_prompt(messages, chat=True)
    expected = eqx_tx.generate(served.base, [prompt], SamplingParams(max_new_tokens=10, temperature=1.0, seed=5),
                               n=3)
    for choice, want in zip(answer.choices, expected):
        assert choice.message.content == tokenizer.decode(want.tokens)
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want.logprobs, rel=1e-4, abs=1e-5)

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=1.0, n=3,
                                            seed=5, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in answer.choices]

    # A stop string cuts the text before it and ends the sample with "stop".
    greedy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    text = greedy.choices[0].text
    stop = text[len(text) // 2 :][:3]
    cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_bad_requests_get_4xx_and_the_server_keeps_serving(served):
    client, loop = served.client, served.loop
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="exceeds max_position_embeddings 2048"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 128\], got 0"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, n=0)
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 128\], got 129"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, n=129)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 0, got -1"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="--max-top-logprobs"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=6)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens="many")  # type: ignore[arg-type]
    answer = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
    assert _idle(loop) == (False, 0)


def test_a_client_leaving_mid_stream_frees_its_pages(served):
    client, loop = served.client, served.loop
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1500, temperature=1.0,
                                       seed=0, stream=True, extra_body={"top_k": 1000})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert _idle(loop)[1] > 0  # the request holds pages while it runs
    stream.close()
    deadline = time.time() + 60
    while _idle(loop) != (False, 0):
        assert time.time() < deadline, "the abandoned request kept running"
        time.sleep(0.1)


def test_a_lora_adapter_is_served_beside_the_base(served):
    """Requests for the base and for its adapter, at once, each equal `generate` with
    that model; the adapter changes the answers."""
    client, tokenizer = served.client, served.tokenizer
    assert {m.id for m in client.models.list()} == {"tiny", "tiny-lora"}
    prompt = "Once upon a time"

    def ask(name: str):
        return client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0.7, seed=3, n=2,
                                         logprobs=1)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = dict(zip(("tiny", "tiny-lora"), pool.map(ask, ("tiny", "tiny-lora"))))
    params = SamplingParams(max_new_tokens=10, temperature=0.7, seed=3)
    for name, model in (("tiny", served.base), ("tiny-lora", served.tuned)):
        assert answers[name].model == name
        for choice, want in zip(answers[name].choices, eqx_tx.generate(model, [tokenizer.encode(prompt)], params, n=2)):
            assert choice.text == tokenizer.decode(want.tokens)
            np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs, rtol=1e-4, atol=1e-5)
    assert [c.text for c in answers["tiny"].choices] != [c.text for c in answers["tiny-lora"].choices]
    assert _idle(served.loop) == (False, 0)


@dataclasses.dataclass
class _Answer:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def _raw(served, method: str, path: str, body: bytes | None = None) -> _Answer:
    """A plain HTTP request to the server (what a client other than the SDK may send)."""
    url = f"{served.client.base_url}".removesuffix("/").removesuffix("/v1") + path
    request = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return _Answer(answer.status, answer.read().decode())
    except urllib.error.HTTPError as e:
        return _Answer(e.code, e.read().decode())


def test_errors_of_any_kind_come_in_openai_format(served):
    bad_json = _raw(served, "POST", "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert bad_json.status_code == 400
    error = bad_json.json()["error"]
    assert error["message"].startswith("the request body is not valid JSON") and error["param"] is None
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        answer = _raw(served, method, path)
        assert answer.status_code == status
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
        assert path in answer.json()["error"]["message"]


def test_a_fresh_server_compiled_every_shape_before_it_listens(trained_tiny, tmp_path):
    """`serve.build` warms the engine up: the first requests of a fresh server, with
    new sizes (n, prompt length), compile nothing, nor do the Tinker API's prompt
    scores (with no alternatives, and with some: the engine's `max_top_logprobs`).
    (With the Tinker API on, the engine's model holds the sampler bank: the base is
    its slot 0.)"""
    serve = load_tool("serve")
    engine = EngineConfig(max_seqs=4, max_tokens_in_cache=1024, page_size=16, prefill_chunk=32, max_top_logprobs=3)
    tinker = TinkerConfig(max_lora_rank=4, max_adapters=1, sampler_adapters=1, state_dir=str(tmp_path))
    loop, app = serve.build(serve.Args(model=trained_tiny, engine=engine, tinker=tinker))
    try:
        with compile_times() as compiles:
            for n, prompt, score in ((1, [5, 6, 7], None), (3, list(range(1, 40)), None),
                                     (1, list(range(3, 30)), (20, 0)), (2, list(range(2, 12)), (9, 2))):
                done = [threading.Event() for _ in range(n)]
                scored = []

                def listen(event, j):
                    if event.prompt_scores is not None:
                        scored.append(event.prompt_scores)
                    if event.finish_reason is not None:
                        done[j].set()

                for j in range(n):
                    loop.submit(prompt, SamplingParams(max_new_tokens=5, temperature=0.5, seed=1), j,
                                functools.partial(listen, j=j), adapter=0, score=score).result(timeout=60)
                assert all(d.wait(60) for d in done)
                if score is not None:  # the scores came, each with the alternatives asked for
                    assert len(scored) == n and all(s.logprobs.shape == (score[0],) and s.top_ids.shape == score
                                                    for s in scored)
    finally:
        app.state.tinker.stop()
        loop.stop()
    assert compiles == []


def test_health_metrics_and_a_log_line_per_request(served, eqx_log):
    assert _raw(served, "GET", "/health").json() == {"status": "ok"}
    for n, prompt in ((3, "A dog"), (1, "Once upon a time there was a little girl who lived in a village")):
        served.client.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=n, temperature=0.5, seed=1)
    answered = [m for m in eqx_log if m.startswith("cmpl-")]
    assert len(answered) == 2 and all("tokens/s" in m and "first token" in m for m in answered)
    assert "+ 15 output tokens" in answered[0] or "+ 15 output tokens" in answered[1]
    text = _raw(served, "GET", "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(lines['eqx_tx:requests_total{endpoint="/v1/completions",status="200"}']) >= 2
    assert int(lines["eqx_tx:generation_tokens_total"]) >= 20
    assert int(lines["eqx_tx:time_to_first_token_seconds_count"]) >= 2
    for gauge in ("num_requests_waiting", "kv_pages_in_use", "prefix_cache_hit_rate", "num_preemptions_total"):
        assert f"eqx_tx:{gauge}" in lines


def test_prompt_lists_zero_tokens_usage_chunks_and_alternatives(served):
    client, tokenizer, model = served.client, served.tokenizer, served.base
    prompts = ["Once upon a time", "The cat sat"]
    answer = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, n=2, temperature=0.9, seed=4,
                                       logprobs=3)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    expected = eqx_tx.generate(model, [tokenizer.encode(p) for p in prompts],
                               SamplingParams(max_new_tokens=6, temperature=0.9, seed=4), n=2)
    for choice, want, prompt in zip(answer.choices, expected, [p for p in prompts for _ in range(2)]):
        assert choice.text == tokenizer.decode(want.tokens)
        # The alternatives are the most likely tokens of the model's distribution at each step.
        ids = tokenizer.encode(prompt) + want.tokens
        logp = jax.nn.log_softmax(np.asarray(eqx_tx.logits(model, np.asarray([ids]))[0], np.float64), axis=-1)
        for step, top in enumerate(choice.logprobs.top_logprobs):
            row = np.asarray(logp[len(ids) - len(want.tokens) - 1 + step])
            best = np.argsort(-row)[:3]
            assert len(top) == 3
            assert sorted(top.values(), reverse=True) == pytest.approx(row[best].tolist(), abs=1e-4)
            assert max(top.values()) >= choice.logprobs.token_logprobs[step] - 1e-5
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)

    empty = client.completions.create(model="tiny", prompt="Once", max_tokens=0)
    assert empty.choices[0].text == "" and empty.choices[0].finish_reason == "length"
    assert empty.usage.completion_tokens == 0

    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    assert _idle(served.loop) == (False, 0)


def test_echo_returns_the_prompt_with_its_logprobs_from_a_forward_pass(served):
    client, tokenizer, model = served.client, served.tokenizer, served.base
    prompt = "Once upon a time there was"
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2)
    ids = tokenizer.encode(prompt)
    choice = answer.choices[0]
    assert choice.text.startswith(prompt) and len(choice.logprobs.token_logprobs) == len(ids) + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    logp = jax.nn.log_softmax(np.asarray(eqx_tx.logits(model, np.asarray([ids]))[0], np.float64), axis=-1)
    want = [logp[t, ids[t + 1]] for t in range(len(ids) - 1)]
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:len(ids)], want, atol=1e-4)
    for t, top in enumerate(choice.logprobs.top_logprobs[1:len(ids)]):
        assert sorted(top.values(), reverse=True) == pytest.approx(np.sort(logp[t])[::-1][:2].tolist(), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, stream=True)


def test_echo_scores_every_prompt_in_the_engine_with_no_tokens_and_with_n(served):
    """Echo of several prompts, scored by the engine's prefill: with `max_tokens=0`
    (one scoring request per prompt, nothing answered but the prompt), with `n=2` (the
    first sample scores), a one-token prompt (nothing to score), and without logprobs
    (the text alone). No request is left in the engine."""
    client, tokenizer, model = served.client, served.tokenizer, served.base
    texts = ["Once upon a time there was", "The cat sat", "A"]
    ids = [tokenizer.encode(t) for t in texts]
    assert len(ids[2]) == 1

    def want(p):
        logp = np.asarray(jax.nn.log_softmax(np.asarray(eqx_tx.logits(model, np.asarray([ids[p]]))[0], np.float64)))
        return [logp[t, ids[p][t + 1]] for t in range(len(ids[p]) - 1)], logp

    for max_tokens, n in ((0, 1), (2, 2)):
        answer = client.completions.create(model="tiny", prompt=texts, max_tokens=max_tokens, n=n, temperature=0,
                                           echo=True, logprobs=1)
        assert len(answer.choices) == len(texts) * n
        for i, choice in enumerate(answer.choices):
            p = i // n
            assert choice.text.startswith(texts[p]) and (max_tokens or choice.text == texts[p])
            assert len(choice.logprobs.token_logprobs) == len(ids[p]) + max_tokens
            assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
            scored, logp = want(p)
            np.testing.assert_allclose(choice.logprobs.token_logprobs[1:len(ids[p])], scored, atol=1e-4)
            for t, top in enumerate(choice.logprobs.top_logprobs[1:len(ids[p])]):
                assert list(top.values()) == pytest.approx([logp[t].max()], abs=1e-4)
        assert answer.usage.completion_tokens == len(texts) * n * max_tokens
    plain = client.completions.create(model="tiny", prompt=texts[:2], max_tokens=0, echo=True)
    assert [c.text for c in plain.choices] == texts[:2] and all(c.logprobs is None for c in plain.choices)
    longest = [ids[0][0]] * served.loop.engine.max_seq_len  # scoring it would need one token more
    with pytest.raises(openai.BadRequestError, match="echo with max_tokens=0"):
        client.completions.create(model="tiny", prompt=longest, max_tokens=0, echo=True, logprobs=0)
    assert _idle(served.loop) == (False, 0)


def test_the_served_name_is_the_checkpoint_s_own(tmp_path):
    serve = load_tool("serve")
    (tmp_path / "runs" / "story" / "final").mkdir(parents=True)
    assert serve.served_name(str(tmp_path / "runs" / "story" / "final")) == "story"
    assert serve.served_name(str(tmp_path / "runs" / "story")) == "story"
    assert serve.served_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_a_final_text_is_the_decoding_of_all_its_tokens(served):
    """A completion that ends inside a character (a byte-level tokenizer's partial
    UTF-8 sequence): the incremental decoder holds it back; the answer does not."""
    import asyncio
    import concurrent.futures as cf

    from eqx_tx.infer.scheduler import TokenEvent
    from eqx_tx.serve.openai import _Job

    tokenizer = served.tokenizer
    tokens = tokenizer.encode("é ☃")[:-1]  # the snowman's last byte is missing
    assert tokenizer.decode(tokens) != "".join(tokenizer.decode_stream()(t) for t in tokens)

    class _Loop:  # the engine thread, reduced to what a job asks of it
        def submit(self, *args, **kwargs):
            future = cf.Future()
            future.set_result(0)
            return future

        def cancel(self, request_id):
            pass

    async def run():
        job = _Job(_Loop(), tokenizer, [[1, 2]], SamplingParams(max_new_tokens=len(tokens)), 1, [], None)
        await job.start()
        for k, t in enumerate(tokens):
            job._events.put_nowait((0, TokenEvent(0, t, -1.0, "length" if k == len(tokens) - 1 else None)))
            await job.next()
        return job.choices[0]

    choice = asyncio.run(run())
    assert choice.text == tokenizer.decode(tokens) and choice.finish_reason == "length"
