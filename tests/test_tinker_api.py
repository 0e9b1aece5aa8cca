"""The Tinker API of tools/serve.py, driven by the official `tinker` SDK over HTTP on
127.0.0.1, with Hugging Face transformers (PyTorch) as the oracle: step-0 losses and
log-probs, each loss's documented formula, training, sampling and prompt log-probs,
independent clients, state round trips, PEFT export, restarts, the API key, and bad
input answered with errors that name the problem while nothing else changes."""

import dataclasses
import os
import time

import numpy as np
import pytest
import torch
import transformers

import tinker
from tinker import types
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from eqx_tx.infer.config import EngineConfig
from eqx_tx.serve.tinker_config import TinkerConfig
from tests.tools_util import Loopback, load_tool

KEY = "tml-test-key"
MAX_RANK = 8


@dataclasses.dataclass
class Server:
    url: str
    app: object
    loop: object
    http: Loopback

    def stop(self):
        self.http.stop()
        self.app.state.tinker.stop()
        self.loop.stop()


def _start(directory: str, state_dir: str) -> Server:
    serve = load_tool("serve")
    engine = EngineConfig(max_seqs=8, max_tokens_in_cache=4096, page_size=16, prefill_chunk=64, max_top_logprobs=5)
    tinker_config = TinkerConfig(max_adapters=12, max_lora_rank=MAX_RANK, sampler_adapters=2, state_dir=state_dir,
                                 tokens_per_call=1024, remat="full")  # auto would compile every policy per shape
    loop, app = serve.build(serve.Args(model=directory, model_name="tiny", engine=engine, tinker=tinker_config,
                                       api_key=KEY, warmup=False))
    http = Loopback(app)
    return Server(http.url, app, loop, http)


@pytest.fixture(scope="module")
def served(trained_tiny, tmp_path_factory):
    os.environ["TINKER_TELEMETRY"] = "0"
    state = str(tmp_path_factory.mktemp("tinker-state"))
    server = _start(trained_tiny, state)
    server.state_dir = state
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return tinker.ServiceClient(base_url=served.url, api_key=KEY)


@pytest.fixture(scope="module")
def hf(trained_tiny):
    return transformers.AutoModelForCausalLM.from_pretrained(trained_tiny, torch_dtype=torch.float32).eval()


def _hf_logprobs(model, tokens: list[int]) -> np.ndarray:
    """`log p(tokens[t + 1] | tokens[: t + 1])` for every t, from PyTorch."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def _datum(tokens: list[int], **inputs) -> types.Datum:
    inputs = {"target_tokens": tokens[1:], **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={k: types.TensorData.from_numpy(np.asarray(v)) for k, v in inputs.items()})


def _tokens(seed: int, n: int, vocab: int = 500) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _logprobs(result) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, np.float64) for o in result.loss_fn_outputs]


def test_step_zero_equals_hugging_face_and_training_lowers_the_loss(client, hf):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    sequences = [(_tokens(1, 5) * 8)[:40], _tokens(2, 7), (_tokens(3, 9) * 10)[:90]]  # patterns: learnable
    weights = [np.random.default_rng(i).uniform(0, 1, len(s) - 1).astype(np.float32) for i, s in enumerate(sequences)]
    data = [_datum(s, weights=w) for s, w in zip(sequences, weights)]
    first = tc.forward_backward(data, "cross_entropy").result()
    expected = [_hf_logprobs(hf, s) for s in sequences]
    for got, want in zip(_logprobs(first), expected):
        np.testing.assert_allclose(got, want, atol=2e-4)
    want_loss = -sum(float(np.sum(w * e)) for w, e in zip(weights, expected))
    assert first.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-4)
    losses = [first.metrics["loss:sum"]]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.9 * losses[0], losses


def _formula(kind: str, logp, q, adv, config, marked=None):
    """The documented per-loss formulas (tinker-docs, Loss Functions), in numpy."""
    ratio = np.exp(logp - q)
    if kind == "gspo":  # every token carries the sequence's ratio (its value)
        ratio = np.full_like(logp, np.exp(np.mean((logp - q)[marked != 0])))
        kind = "ppo"
    if kind == "importance_sampling":
        return -np.sum(ratio * adv)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if kind == "ppo":
        return -np.sum(np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv))
    if kind == "cispo":
        return -np.sum(np.clip(ratio, lo, hi) * logp * adv)
    assert kind == "dro"
    beta = config.get("beta", 0.05)
    return -np.sum(logp * adv - 0.5 * beta * (logp - q) ** 2)


@pytest.mark.parametrize("kind,config", [("importance_sampling", None), ("ppo", None),
                                         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
                                         ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}),
                                         ("dro", {"beta": 0.3}), ("gspo", None),
                                         ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})])
def test_each_loss_equals_its_formula_on_the_returned_logprobs(client, hf, kind, config):
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=1).result()
    rng = np.random.default_rng(5)
    sequences = [_tokens(7, 30), _tokens(8, 12)]
    expected = [_hf_logprobs(hf, s) for s in sequences]
    data, qs, advs, marks = [], [], [], []
    for s, e in zip(sequences, expected):
        q = (e + rng.normal(0, 0.3, len(e))).astype(np.float32)  # ratios on both sides of the clip range
        adv = rng.normal(0, 1, len(e)).astype(np.float32)
        marked = (np.arange(len(e)) >= 3).astype(np.float32)  # e.g. the sampled tokens after a prompt
        extra = {"sequence_ratio_mask": marked} if kind == "gspo" else {}
        data.append(_datum(s, logprobs=q, advantages=adv, **extra))
        qs.append(q)
        advs.append(adv)
        marks.append(marked)
    result = tc.forward_backward(data, kind, loss_fn_config=config).result()
    logps = _logprobs(result)
    for got, want in zip(logps, expected):
        np.testing.assert_allclose(got, want, atol=2e-4)
    want = sum(_formula(kind, lp, q, a, config or {}, m) for lp, q, a, m in zip(logps, qs, advs, marks))
    assert result.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = tc.forward(data, kind, loss_fn_config=config).result()
    assert not np.allclose(_logprobs(after)[0], logps[0])  # the loss's gradient moved the weights
    client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


async def _unload(client, model_id):
    """Unload a run (the SDK has no call for it) and wait until it is unloaded."""
    with client.holder.aclient(ClientConnectionPoolType.TRAIN) as c:
        answer = await c.post("/api/v1/unload_model", body={"model_id": model_id, "type": "unload_model"},
                              cast_to=object)
        while True:
            result = await c.post("/api/v1/retrieve_future", body={"request_id": answer["request_id"]},
                                  cast_to=object)
            if result.get("type") != "try_again":
                assert result.get("model_id") == model_id, result
                return


def test_a_custom_loss_trains_through_forward_backward_custom(client, hf):
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=2).result()
    tokens = _tokens(11, 20)
    data = [_datum(tokens, weights=np.ones(19, np.float32))]

    def squared(data, logprobs):
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"squared:sum": float(loss)}

    result = tc.forward_backward_custom(data, squared).result()
    want = _hf_logprobs(hf, tokens)
    assert result.metrics["loss:sum"] == pytest.approx(float(np.sum(want**2)), rel=1e-3)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    again = tc.forward(data, "cross_entropy").result()
    assert np.sum(_logprobs(again)[0] ** 2) < np.sum(want**2)  # the custom loss went down
    client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


def test_sampling_and_prompt_logprobs_equal_a_forward_pass(client, served, hf):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tokens = _tokens(4, 24)
    tc.forward_backward([_datum(tokens)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    trained = tc.forward([_datum(tokens)], "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokens[:10]
    result = sampler.sample(types.ModelInput.from_ints(prompt), 3,
                            types.SamplingParams(max_tokens=12, temperature=1.0, seed=7),
                            include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert len(result.sequences) == 3
    # the prompt's log-probs are the trained adapter's (as forward() gives them)
    np.testing.assert_allclose(result.prompt_logprobs[1:], _logprobs(trained)[0][:9], atol=2e-4)
    assert result.prompt_logprobs[0] is None
    top = result.topk_prompt_logprobs
    assert top[0] is None and all(len(row) == 3 for row in top[1:])
    for row, lp in zip(top[1:], result.prompt_logprobs[1:]):
        assert row[0][1] >= lp - 1e-5 and [x[1] for x in row] == sorted([x[1] for x in row], reverse=True)
    for seq in result.sequences:  # sampled log-probs: the model's distribution on those tokens
        full = prompt + list(seq.tokens)
        forward = tc.forward([_datum(full)], "cross_entropy").result()
        np.testing.assert_allclose(seq.logprobs, _logprobs(forward)[0][len(prompt) - 1:], atol=2e-4)
    # the base model samples as Hugging Face computes it
    base = client.create_sampling_client(base_model="tiny").result()
    logprobs = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(np.asarray(logprobs[1:], np.float64), _hf_logprobs(hf, tokens), atol=2e-4)
    cached = served.loop.call(lambda engine: engine.stats()["cached_tokens"])
    last = base.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=4).result()
    assert last[:-4] == [None] * (len(tokens) - 4)
    np.testing.assert_allclose(last[-4:], logprobs[-4:], atol=1e-5)
    # the prefix before the 4 scored tokens came from the prefix cache: its first page of 16
    assert served.loop.call(lambda engine: engine.stats()["cached_tokens"]) - cached == 16
    greedy = base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[]), topk_sample_logprobs=2).result().sequences[0]
    assert greedy.stop_reason == "length" and len(greedy.tokens) == 6
    full = prompt + list(greedy.tokens)
    hf_lp = _hf_logprobs(hf, full)[len(prompt) - 1:]
    np.testing.assert_allclose(greedy.logprobs, hf_lp, atol=2e-4)
    assert [row[0][0] for row in greedy.topk_logprobs] == list(greedy.tokens)  # greedy: the top token


def test_old_ephemeral_samplers_are_dropped_with_a_clear_error(client, served):
    keep = served.app.state.tinker.config.snapshots_per_run
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=14).result()
    samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(keep + 1)]
    prompt = types.ModelInput.from_ints(_tokens(61, 6))
    for sampler in samplers[1:]:  # the newest ones sample
        assert len(sampler.compute_logprobs(prompt).result()) == 6
    with pytest.raises(Exception, match="weights were dropped.*--snapshots-per-run"):
        samplers[0].compute_logprobs(prompt).result()
    client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


def test_two_clients_stay_independent_and_state_round_trips(client, served):
    a = client.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    b = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tokens = _tokens(21, 30)
    data = [_datum(tokens)]
    b_before = _logprobs(b.forward(data, "cross_entropy").result())[0]
    for _ in range(2):
        a.forward_backward(data, "cross_entropy")
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = a.save_state("two-steps").result().path
    a_saved = _logprobs(a.forward(data, "cross_entropy").result())[0]
    np.testing.assert_array_equal(_logprobs(b.forward(data, "cross_entropy").result())[0], b_before)
    # one more step from the saved state, twice: once live, once in a client loaded with the optimizer
    a.forward_backward(data, "cross_entropy")
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a_next = _logprobs(a.forward(data, "cross_entropy").result())[0]
    d = client.create_training_client_from_state_with_optimizer(saved).result()
    np.testing.assert_allclose(_logprobs(d.forward(data, "cross_entropy").result())[0], a_saved, atol=1e-6)
    d.forward_backward(data, "cross_entropy")
    d.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_allclose(_logprobs(d.forward(data, "cross_entropy").result())[0], a_next, atol=1e-5)
    c = client.create_training_client_from_state(saved).result()
    np.testing.assert_allclose(_logprobs(c.forward(data, "cross_entropy").result())[0], a_saved, atol=1e-6)
    paths = [x.tinker_path for x in tinker.RestClient(base_url=served.url, api_key=KEY)
             .list_checkpoints(a.model_id).result().checkpoints]
    assert saved in paths
    for tc in (a, b, c, d):
        client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


def test_a_sampler_checkpoint_is_a_peft_adapter_and_survives_a_restart(client, served, trained_tiny, tmp_path):
    import peft
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    tokens = _tokens(31, 16)
    tc.forward_backward([_datum(tokens)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    want = _logprobs(tc.forward([_datum(tokens)], "cross_entropy").result())[0]
    path = tc.save_weights_for_sampler("exported").result().path
    directory = served.app.state.tinker.store.get(path)["directory"]
    base = transformers.AutoModelForCausalLM.from_pretrained(trained_tiny, torch_dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, directory).eval()
    np.testing.assert_allclose(_hf_logprobs(tuned, tokens), want, atol=2e-4)
    sampler = client.create_sampling_client(model_path=path).result()
    got = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(got[1:], want, atol=2e-4)
    # a second server on the same state directory: the checkpoint is there and samples the same
    other = _start(trained_tiny, served.state_dir)
    try:
        fresh = tinker.ServiceClient(base_url=other.url, api_key=KEY)
        again = fresh.create_sampling_client(model_path=path).result().compute_logprobs(
            types.ModelInput.from_ints(tokens)).result()
        np.testing.assert_allclose(again[1:], want, atol=2e-4)
        rest = tinker.RestClient(base_url=other.url, api_key=KEY)
        assert path in [x.tinker_path for x in rest.list_checkpoints(tc.model_id).result().checkpoints]
        old_id = served.app.state.tinker.futures.new()[0]  # a future of the first server
        stale = other.app.state.tinker.futures
        with pytest.raises(ValueError, match="restarted"):
            stale.get(old_id)
        rest.delete_checkpoint(tc.model_id, "sampler_weights/exported").result()
        assert path not in [x.tinker_path for x in rest.list_checkpoints(tc.model_id).result().checkpoints]
    finally:
        other.stop()
    client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


def test_bad_input_names_the_problem_and_changes_nothing(client, served):
    good = client.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
    tokens = _tokens(41, 20)
    data = [_datum(tokens)]
    good.forward_backward(data, "cross_entropy")
    good.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = _logprobs(good.forward(data, "cross_entropy").result())[0]
    service = served.app.state.tinker
    slot = service.runs[good.model_id].slot
    moments = service.trainer.slot_state(slot)

    with pytest.raises(Exception, match="unknown base model 'nope'"):
        client.create_lora_training_client(base_model="nope", rank=4).result()
    with pytest.raises(Exception, match=r"rank 64 is outside \[1, 8\]"):
        client.create_lora_training_client(base_model="tiny", rank=64).result()
    bad = client.create_lora_training_client(base_model="tiny", rank=2, seed=9).result()
    cases = [
        ([_datum(tokens, weights=np.ones(5, np.float32))], "cross_entropy", None, r"'weights'\] has shape \[5\]"),
        ([_datum(tokens[:-1] + [10**6])], "cross_entropy", None, "outside the vocabulary"),
        ([_datum(_tokens(1, 3000))], "cross_entropy", None, "more than the model's maximum"),
        (data, "no_such_loss", None, "unknown loss_fn 'no_such_loss'"),
        ([_datum(tokens, logprobs=np.zeros(19, np.float32), advantages=np.zeros(19, np.float32))], "ppo",
         {"clip_eps": 0.2}, "'clip_eps' is not a setting of 'ppo'"),
        ([_datum(tokens)], "ppo", None, r"'ppo' needs loss_fn_inputs\['logprobs'\]"),
    ]
    for datums, loss, config, message in cases:
        with pytest.raises(Exception, match=message):
            bad.forward_backward(datums, loss, loss_fn_config=config).result()
    with pytest.raises(Exception, match="no checkpoint at tinker://"):
        client.create_training_client_from_state(f"tinker://{bad.model_id}/weights/missing").result()
    with pytest.raises(Exception, match="must look like tinker://"):
        client.create_sampling_client(model_path="tinker://just-a-run").result().sample(
            types.ModelInput.from_ints(tokens[:3]), 1, types.SamplingParams(max_tokens=2)).result()
    sampler = client.create_sampling_client(base_model="tiny").result()
    with pytest.raises(Exception, match="maximum sequence length"):
        sampler.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=100000)).result()
    # nothing of the good run changed, and it trains on
    np.testing.assert_array_equal(_logprobs(good.forward(data, "cross_entropy").result())[0], before)
    after = service.trainer.slot_state(slot)
    for part in ("params", "m", "v"):
        for name in moments[part]:
            np.testing.assert_array_equal(after[part][name], moments[part][name])
    good.forward_backward(data, "cross_entropy")
    good.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_two_clients_forward_backward_passes_run_in_one_batch(client, served):
    import concurrent.futures as cf

    service = served.app.state.tinker
    a = client.create_lora_training_client(base_model="tiny", rank=4, seed=12).result()
    b = client.create_lora_training_client(base_model="tiny", rank=4, seed=13).result()
    data_a, data_b = [_datum(_tokens(51, 25))], [_datum(_tokens(52, 14)), _datum(_tokens(53, 30))]
    alone = [_logprobs(x.forward(d, "cross_entropy").result()) for x, d in ((a, data_a), (b, data_b))]
    calls = []
    original = service.trainer.forward_backward

    def recording(slots, *args, **kwargs):
        calls.append(list(slots) if not isinstance(slots, int) else [slots])
        return original(slots, *args, **kwargs)

    service.trainer.forward_backward = recording
    gate = cf.Future()
    service.worker.submit(lambda: gate.result(), cf.Future())  # hold the worker while both are queued
    try:
        fa, fb = a.forward(data_a, "cross_entropy"), b.forward(data_b, "cross_entropy")
        while service.worker._inbox.qsize() < 2:
            time.sleep(0.01)
        gate.set_result(None)
        together = [_logprobs(fa.result()), _logprobs(fb.result())]
    finally:
        service.trainer.forward_backward = original
    slots = {service.runs[x.model_id].slot for x in (a, b)}
    assert len(calls) == 1 and set(calls[0]) == slots  # one call of the bank, both runs' datums
    for got, want in zip(together, alone):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5)
    for tc in (a, b):
        client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


def test_slots_run_out_with_a_clear_error_and_a_finished_session_frees_its_slots(client, served):
    service = served.app.state.tinker
    other = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    taken = [other.create_lora_training_client(base_model="tiny", rank=2, seed=i).result()
             for i in range(len(service.free_slots))]
    with pytest.raises(Exception, match="training slots are in use.*--max-adapters"):
        client.create_lora_training_client(base_model="tiny", rank=2).result()
    other.close("success").result()  # the session ends: its runs are unloaded
    assert all(tc.model_id not in service.runs for tc in taken)
    tc = client.create_lora_training_client(base_model="tiny", rank=2).result()
    client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()
    # a session whose client went away without closing: its runs make room when needed
    gone = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    abandoned = [gone.create_lora_training_client(base_model="tiny", rank=2, seed=i).result()
                 for i in range(len(service.free_slots))]
    task = gone.holder._session_heartbeat_task  # the client dies: no more heartbeats
    gone.holder.get_loop().call_soon_threadsafe(task.cancel)
    time.sleep(0.5)
    service.sessions[gone.holder.get_session_id()] -= service.config.session_timeout_s + 1
    tc = client.create_lora_training_client(base_model="tiny", rank=2).result()
    assert all(a.model_id not in service.runs for a in abandoned)
    client.holder.run_coroutine_threadsafe(_unload(client, tc.model_id)).result()


def test_requests_without_the_api_key_are_refused(served):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(served.url + "/api/v1/get_server_capabilities")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 401
    request = urllib.request.Request(served.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 401
    ok = urllib.request.Request(served.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
    assert b'"tiny"' in urllib.request.urlopen(ok, timeout=30).read()
