"""GRPO in one process: sample n answers per prompt with the current weights, score
them, and take a policy-gradient step on the sampled tokens. The sampler and the
trainer share one model in memory: no weight copies between them. Answers are
sampled by `eqx_tx.Engine` (continuous batching over a paged KV cache: an answer
that ends early frees its slot and pages for the next) or, with `--sampler
generate`, by one static `generate` batch per step; both give the same tokens.

With no prompts file it runs the built-in arithmetic task (`a+b=` with single-digit
operands, reward: exact match of the sum) on a model first taught the task's format
by `tools/train.py` (`--data arithmetic`, the same facts written out as text):

    python tools/train.py --data arithmetic --output-dir runs/arith --total-steps 50 --seq-len 32
    python tools/grpo.py --model runs/arith/final --output-dir runs/arith-grpo

Prompts come from a jsonl with a `prompt` field (a text, or a chat: a list of
messages, rendered with the chat template) and whatever the reward
function reads (the built-in `eqx_tx.rl:exact_match` compares the completion's final
answer with `answer`). `--reward module:function` names any function
`(completion: str, example: dict) -> float`. The loss (`--loss ppo|is|cispo|gspo`,
clipping, KL, entropy, normalisation) is the library's `PolicyLoss`; `--lora-rank`
trains adapters on a frozen base (whose log-probs are then the KL reference),
otherwise every weight trains. Progress, checkpoints and `--resume` work as in
`tools/train.py`; every step's figures go to OUTPUT_DIR/metrics.jsonl and the reward
curve to OUTPUT_DIR/reward.svg.
"""

import dataclasses
import importlib
import json
import os
import time
from typing import Annotated, Literal

import tyro

from eqx_tx.cli import check_output_dir, check_resume, run_tool
from eqx_tx.layers.lora import ALL_TARGETS
from eqx_tx.train.policy import PolicyLoss
from eqx_tx.train.training import OptimizerConfig


@dataclasses.dataclass
class Args:
    model: str
    """A local HF directory or hub repo id (its tokenizer.json is used)."""
    output_dir: str = "runs/grpo"
    """Checkpoints go to OUTPUT_DIR/checkpoint, the final HF model to OUTPUT_DIR/final."""
    prompts: str = "arithmetic"
    """A jsonl with a 'prompt' field per line, or 'arithmetic' for the built-in task."""
    reward: str = "eqx_tx.rl:exact_match"
    """module:function scoring (completion text, example dict) -> float."""
    steps: int = 60
    """Optimizer steps; each samples --prompts-per-step prompts x --n answers."""
    prompts_per_step: int = 16
    n: int = 8
    """Answers sampled per prompt (one group)."""
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    sampler: Literal["engine", "generate"] = "engine"
    """engine: continuous batching over a paged KV cache; generate: one static batch."""
    engine_slots: int | None = None
    """Sequences the engine decodes at once (default: --prompts-per-step x --n)."""
    scale_advantages: bool = True
    """GRPO: divide by the group's reward std; --no-scale-advantages: Dr. GRPO."""
    policy: Annotated[PolicyLoss, tyro.conf.OmitArgPrefixes] = PolicyLoss()
    """The policy-gradient objective."""
    optimizer: Annotated[OptimizerConfig, tyro.conf.OmitArgPrefixes] = OptimizerConfig(
        learning_rate=5e-4, warmup_steps=5)
    """AdamW; the schedule's length is --steps."""
    max_tokens_per_micro_batch: int | None = None
    """Pack the rollouts into micro-batches of this many tokens (per data-parallel
    device) instead of one padded batch: long-tailed answer lengths waste no padding."""
    lora_rank: int = 0
    """0 = every weight trains; > 0 = LoRA adapters of this rank on a frozen base."""
    lora_alpha: float = 16.0
    eval_every: int = 10
    """Every this many steps (and before the first), the reward over the whole built-in
    task (or the first 64 prompts of the file), n samples each."""
    resume: bool = False
    """Continue from OUTPUT_DIR/checkpoint where it stopped."""
    overwrite: bool = False
    """Write into an OUTPUT_DIR that already holds files."""
    save_every: int = 20
    stop_after: int | None = None
    """Stop (after saving a checkpoint) once this many steps ran in this process."""
    seed: int = 0
    progress: bool = True


def load_reward(spec: str):
    """The function named `module:function`."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--reward {spec!r} is not module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is not callable")
    return fn


def load_prompts(spec: str) -> tuple[list[dict], list[dict]]:
    """Training examples and the evaluation set."""
    from eqx_tx.train.data import read_jsonl
    from eqx_tx.rl import arithmetic_facts

    if spec == "arithmetic":
        return arithmetic_facts(), arithmetic_facts()
    examples = read_jsonl(spec, fields=("prompt",), what="prompts file")
    if not examples:
        raise ValueError(f"prompts file {spec} holds no prompts")
    return examples, examples[:64]


def _check(args: Args) -> None:
    for name in ("steps", "prompts_per_step", "n", "max_new_tokens", "save_every", "eval_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.n < 2:
        raise ValueError("--n must be >= 2: advantages compare the answers to one prompt")
    check_output_dir(args.output_dir, resume=args.resume, overwrite=args.overwrite)


def _run_metadata(args: Args) -> dict:
    """What a `--resume` must share with the checkpoint it continues (JSON values)."""
    prompts = args.prompts if args.prompts == "arithmetic" else os.path.abspath(args.prompts)
    return {"model": args.model, "prompts": prompts, "reward": args.reward, "n": args.n,
            "prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "lora_rank": args.lora_rank,
            "policy": dataclasses.asdict(args.policy), "seed": args.seed}


def write_svg(path: str, points: list[tuple[int, float]], evals: list[tuple[int, float]]) -> None:
    """The reward per step (and the evaluation reward) as a small SVG line chart."""
    W, H, pad = 480, 240, 30
    last = max([s for s, _ in points + evals] + [1])

    def xy(s, r):
        return pad + (W - 2 * pad) * s / last, H - pad - (H - 2 * pad) * min(max(r, 0.0), 1.0)

    def line(pts, colour):
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, r) for s, r in pts))
        return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'

    with open(path + ".tmp", "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="11">\n'
                f'<rect width="{W}" height="{H}" fill="white"/>\n'
                f'<line x1="{pad}" y1="{H - pad}" x2="{W - pad}" y2="{H - pad}" stroke="black"/>\n'
                f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H - pad}" stroke="black"/>\n'
                f'<text x="{pad}" y="{pad - 8}">reward (blue: per step, red: evaluation), 0..1 over {last} steps</text>\n'
                f"{line(points, 'steelblue')}\n{line(evals, 'firebrick')}\n</svg>\n")
    os.replace(path + ".tmp", path)


class Rollouts:
    """Sampling and scoring with the current weights."""

    PAGE_SIZE = 16

    def __init__(self, args: Args, tokenizer, reward, model, examples: list[dict]):
        import eqx_tx
        from eqx_tx.core.util import ceil_div
        from eqx_tx.infer.config import EngineConfig

        self.args, self.tokenizer, self.reward = args, tokenizer, reward
        self.engine = None
        if args.sampler == "engine":
            slots = args.engine_slots or args.prompts_per_step * args.n
            longest = max(len(tokenizer.encode_prompt(e["prompt"])) for e in examples) + args.max_new_tokens
            config = EngineConfig(max_seqs=slots, page_size=self.PAGE_SIZE,
                                  max_tokens_in_cache=slots * ceil_div(longest, self.PAGE_SIZE) * self.PAGE_SIZE,
                                  prefill_rows=min(64, 1 << (slots - 1).bit_length()))
            self.engine = eqx_tx.Engine(model, config)

    def sample(self, model, examples: list[dict], seed: int):
        import numpy as np

        import eqx_tx

        prompts = [self.tokenizer.encode_prompt(e["prompt"]) for e in examples]
        params = eqx_tx.SamplingParams(max_new_tokens=self.args.max_new_tokens, temperature=self.args.temperature,
                                       top_p=self.args.top_p, seed=seed)
        if self.engine is None:
            gens = eqx_tx.generate(model, prompts, params, n=self.args.n)
        else:  # the same tokens as generate (each request's own seed stream and positions)
            self.engine.set_model(model)
            gens = self.engine.run([(p, params) for p in prompts], n=self.args.n)
        texts = [self.tokenizer.decode(g.tokens[:-1] if g.stop_reason == "stop" else g.tokens) for g in gens]
        rewards = np.array([float(self.reward(t, examples[i // self.args.n])) for i, t in enumerate(texts)])
        return prompts, gens, rewards.reshape(len(examples), self.args.n)


def main(args: Args) -> None:
    import jax
    import numpy as np
    from tqdm.auto import tqdm

    import eqx_tx
    from eqx_tx.train.checkpoint import restore_checkpoint, save_checkpoint
    from eqx_tx.io.loading import resolve_source
    from eqx_tx.rl import group_advantages, rollout_batch
    from eqx_tx.io.saving import tokenizer_files
    from eqx_tx.infer.text import Tokenizer
    from eqx_tx.train.training import TrainConfig

    eqx_tx.enable_console_logging()
    _check(args)
    reward = load_reward(args.reward)
    examples, eval_set = load_prompts(args.prompts)
    source = resolve_source(args.model)
    tokenizer = Tokenizer.from_directory(source)
    model = eqx_tx.load(source, progress=args.progress)
    eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
    if args.lora_rank > 0:
        model = eqx_tx.apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=ALL_TARGETS,
                                  key=jax.random.key(args.seed + 1))
    reference = None
    if args.policy.kl_coef:  # LoRA: the frozen base; full fine-tuning: a copy of the starting weights
        reference = eqx_tx.layers.lora.without_adapters(model) if args.lora_rank > 0 else jax.tree.map(
            lambda x: x.copy() if isinstance(x, jax.Array) else x, model)
    config = TrainConfig(optimizer=dataclasses.replace(args.optimizer, total_steps=args.steps),
                         policy_loss=args.policy, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)
    state = eqx_tx.init_train_state(model, config)
    del model
    os.makedirs(args.output_dir, exist_ok=True)
    checkpoint_dir = os.path.join(args.output_dir, "checkpoint")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if args.resume:
        check_resume(checkpoint_dir, _run_metadata(args))
        state, meta = restore_checkpoint(checkpoint_dir, state)
        print(f"resumed from {checkpoint_dir} at step {meta['step']}")
    start = int(state.step)
    history = []
    if os.path.isfile(metrics_path):  # keep the steps before `start` (resume), drop any after
        with open(metrics_path) as f:
            history = [r for r in map(json.loads, f) if r["step"] < start]
    rollouts = Rollouts(args, tokenizer, reward, state.model, examples + eval_set)

    def evaluate(step):
        _, _, r = rollouts.sample(state.model, eval_set, seed=10**6 + step)
        return float(r.mean())

    def record(row):
        history.append(row)
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
        os.replace(metrics_path + ".tmp", metrics_path)

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=not args.progress, desc="grpo")
    tokens = 0
    t0 = time.perf_counter()
    for step in bar:
        row = {"step": step}
        if step % args.eval_every == 0:
            row["eval_reward"] = evaluate(step)
        order = np.random.default_rng([args.seed, step]).choice(len(examples), args.prompts_per_step,
                                                                  replace=len(examples) < args.prompts_per_step)
        batch_examples = [examples[i] for i in order]
        prompts, gens, rewards = rollouts.sample(state.model, batch_examples, seed=step)
        batch = rollout_batch(prompts, gens, group_advantages(rewards, scale=args.scale_advantages), pad_id=eos)
        if reference is not None:
            batch = dataclasses.replace(batch, reference_logprobs=np.asarray(eqx_tx.token_logprobs(
                reference, batch.input_ids, batch.target_ids,
                attention_mask=np.arange(batch.input_ids.shape[1]) < batch.lengths[:, None])))
        state, metrics = eqx_tx.train_step(state, batch, config)
        tokens += sum(len(g.tokens) for g in gens)
        row |= {"reward": float(rewards.mean()), **{k: float(v) for k, v in metrics.items()},
                "sampled_tokens_per_s": tokens / (time.perf_counter() - t0)}
        record(row)
        bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row.get('kl', 0.0):.4f}",
                        clip=f"{row['clip_fraction']:.3f}", tok_s=f"{row['sampled_tokens_per_s']:,.0f}")
        if not args.progress and (step + 1) % 10 == 0:
            print(f"step {step + 1}: reward {row['reward']:.3f} clip {row['clip_fraction']:.3f} "
                  f"kl {row.get('kl', 0.0):.4f} sampled tokens/s {row['sampled_tokens_per_s']:,.0f}")
        stopping = args.stop_after is not None and step + 1 - start >= args.stop_after
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stopping:
            save_checkpoint(checkpoint_dir, state, metadata=dict(_run_metadata(args), data_position=step + 1))
        if stopping:
            print(f"stopped after step {step + 1}; continue with --resume")
            return
    bar.close()
    record({"step": args.steps, "eval_reward": evaluate(args.steps)})
    points = [(r["step"], r["reward"]) for r in history if "reward" in r]
    evals = [(r["step"], r["eval_reward"]) for r in history if "eval_reward" in r]
    write_svg(os.path.join(args.output_dir, "reward.svg"), points, evals)
    print(f"evaluation reward {evals[0][1]:.3f} -> {evals[-1][1]:.3f}")
    model = state.model
    if args.lora_rank > 0:
        eqx_tx.save_adapter(model, os.path.join(args.output_dir, "adapter"), base_model_name_or_path=args.model)
        model = eqx_tx.merge_lora(model)
    eqx_tx.save(model, os.path.join(args.output_dir, "final"), extra_files=tokenizer_files(source))


if __name__ == "__main__":
    run_tool(main, Args)
