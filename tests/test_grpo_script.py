"""tools/grpo.py: GRPO raises the reward of the built-in arithmetic task, across a
resume; its engine and static-batch samplers give the same rollouts."""

import dataclasses
import json
import os

import equinox as eqx
import jax
import numpy as np
import pytest

import eqx_tx
from eqx_tx.rl import arithmetic_facts, exact_match
from eqx_tx.train.policy import PolicyLoss
from eqx_tx.train.training import OptimizerConfig
from tests.tools_util import load_tool, shared_run, tool_args


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory, worker_id):
    """The tiny preset taught the task's format by tools/train.py (50 steps), once per
    session (the xdist workers share it)."""
    train = load_tool("train")
    return shared_run(tmp_path_factory, worker_id, "arithmetic-sft", lambda out: train.main(
        tool_args(train, steps=50, output_dir=str(out), data="arithmetic", seq_len=32, progress=False,
                  overwrite=True)))


def test_grpo_raises_the_reward_across_a_resume(warm_start, tmp_path, capsys):
    grpo = load_tool("grpo")
    out = tmp_path / "rl"
    # The static sampler: faster than the engine for 4-token answers, and the same tokens
    # (test_engine_and_generate_give_the_same_rollouts; the LoRA test runs the engine).
    settings = dict(model=warm_start, output_dir=str(out), sampler="generate", progress=False,
                    optimizer=OptimizerConfig(learning_rate=5e-4, warmup_steps=5, total_steps=40))
    grpo.main(grpo.Args(**settings, stop_after=20))
    assert "stopped after step 20" in capsys.readouterr().out
    grpo.main(grpo.Args(**settings, resume=True))
    assert "at step 20" in capsys.readouterr().out
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "reward" in r]
    # The first step of each process compiles: marked, and its time kept apart from the others'.
    assert [r["step"] for r in steps if r["compiled"]] == [0, 20]
    assert all(r["sample_seconds"] > 0 and r["sampled_tokens_per_s"] > 0 for r in steps)
    rewards = [r["reward"] for r in rows if "reward" in r]
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    assert len(rewards) == 40 and [r["step"] for r in rows if "reward" in r] == list(range(40))
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.08, (first, last, rewards)
    assert evals[-1] > evals[0] + 0.05, evals
    assert all(0.0 <= r["clip_fraction"] <= 1.0 and np.isfinite(r["loss"]) for r in rows if "reward" in r)
    assert os.path.isfile(out / "reward.svg") and os.path.isfile(out / "final" / "model.safetensors")
    with pytest.raises(ValueError, match=r"different settings than the checkpoint .*'n': \(8, 4\)"):
        grpo.main(grpo.Args(**dict(settings, n=4), resume=True))


def test_grpo_refuses_bad_arguments(warm_start, tmp_path):
    grpo = load_tool("grpo")
    with pytest.raises(ValueError, match="module:function"):
        grpo.main(grpo.Args(model=warm_start, output_dir=str(tmp_path / "a"), reward="nocolon"))
    with pytest.raises(ValueError, match="no_such_function"):
        grpo.main(grpo.Args(model=warm_start, output_dir=str(tmp_path / "b"), reward="eqx_tx.rl:no_such_function"))
    with pytest.raises(ValueError, match="--n must be >= 2"):
        grpo.main(grpo.Args(model=warm_start, output_dir=str(tmp_path / "c"), n=1))


def test_grpo_lora_with_kl_to_the_base(warm_start, tmp_path):
    """LoRA on a frozen base, KL to the base's log-probs: it runs, reports a KL that starts at 0
    (adapters start as the identity) and grows, and exports the adapter and the merged model."""
    grpo = load_tool("grpo")
    out = tmp_path / "lora"
    grpo.main(grpo.Args(model=warm_start, output_dir=str(out), lora_rank=4, lora_alpha=8.0, prompts_per_step=4, n=4,
                        optimizer=OptimizerConfig(learning_rate=5e-4, warmup_steps=5, total_steps=4),
                        policy=dataclasses.replace(PolicyLoss(), kl_coef=0.05), eval_every=100, progress=False))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if "reward" in json.loads(line)]
    assert abs(rows[0]["kl"]) < 1e-6 and rows[-1]["kl"] > 0
    assert os.path.isfile(out / "adapter" / "adapter_model.safetensors")
    assert os.path.isfile(out / "final" / "model.safetensors")


def test_engine_and_generate_give_the_same_rollouts(warm_start):
    """The engine (continuous batching, fewer slots than sequences here) samples the
    very tokens of one static `generate` batch, before and after the weights change."""
    grpo = load_tool("grpo")
    model = eqx_tx.load(warm_start, progress=False)
    tokenizer = eqx_tx.load_tokenizer(warm_start)
    examples = arithmetic_facts()[:6]
    changed = jax.tree.map(lambda x: x * 1.1 if eqx.is_inexact_array(x) and x.ndim == 3 else x, model)
    rollouts = {}
    for sampler in ("engine", "generate"):
        args = grpo.Args(model=warm_start, sampler=sampler, engine_slots=8, prompts_per_step=6, n=4, temperature=1.0)
        r = grpo.Rollouts(args, tokenizer, exact_match, model, examples)
        rollouts[sampler] = [r.sample(m, examples, seed=3) for m in (model, changed)]
    for (_, engine, engine_rewards), (_, static, static_rewards) in zip(rollouts["engine"], rollouts["generate"]):
        assert [g.tokens for g in engine] == [g.tokens for g in static]
        for a, b in zip(engine, static):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(engine_rewards, static_rewards)
    before, after = (np.concatenate([g.logprobs for g in r[1]]) for r in rollouts["engine"])
    assert before.shape != after.shape or not np.allclose(before, after, atol=1e-3)  # the new weights were used
