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
import os
import sys
import time
from typing import Annotated, Literal

import tyro

from eqx_tx.cli import StopSignals, check_output_dir, check_resume, run_tool
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
    prompts_per_step: int = 16
    """Prompts sampled per optimizer step (each gets --n answers: one group)."""
    n: int = 8
    """Answers sampled per prompt (one group)."""
    max_new_tokens: int = 4
    """Tokens each answer may have at most."""
    temperature: float = 1.0
    """Sampling temperature of the answers (0: greedy, which leaves a group nothing to compare)."""
    top_p: float = 1.0
    """Nucleus sampling of the answers (1.0: the whole distribution)."""
    sampler: Literal["engine", "generate"] = "engine"
    """engine: continuous batching over a paged KV cache; generate: one static batch."""
    engine_slots: int | None = None
    """Sequences the engine decodes at once (default: --prompts-per-step x --n)."""
    scale_advantages: bool = True
    """GRPO: divide by the group's reward std; --no-scale-advantages: Dr. GRPO."""
    policy: Annotated[PolicyLoss, tyro.conf.OmitArgPrefixes] = PolicyLoss()
    """The policy-gradient objective."""
    optimizer: Annotated[OptimizerConfig, tyro.conf.OmitArgPrefixes] = OptimizerConfig(
        learning_rate=5e-4, warmup_steps=5, total_steps=60)
    """AdamW and its schedule; --total-steps is the run's length in optimizer steps, each
    sampling --prompts-per-step prompts x --n answers."""
    max_tokens_per_micro_batch: int | None = None
    """Pack the rollouts into micro-batches of this many tokens (per data-parallel
    device) instead of one padded batch: long-tailed answer lengths waste no padding."""
    lora_rank: int = 0
    """0 = every weight trains; > 0 = LoRA adapters of this rank on a frozen base."""
    lora_alpha: float = 16.0
    """LoRA scale numerator (scaling = alpha / rank)."""
    eval_every: int = 10
    """Every this many steps (and before the first), the reward over the whole built-in
    task (or the first 64 prompts of the file), n samples each."""
    resume: bool = False
    """Continue from OUTPUT_DIR/checkpoint where it stopped."""
    overwrite: bool = False
    """Write into an OUTPUT_DIR that already holds files."""
    save_every: int = 20
    """Steps between checkpoints (one is always written at the end)."""
    stop_after: int | None = None
    """Stop (after saving a checkpoint) once this many steps ran in this process."""
    seed: int = 0
    """Adapter initialisation, prompt order and sampling seed."""
    progress: bool = True
    """Show a progress bar (else print each step's line)."""


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
    from eqx_tx.rl import arithmetic_facts
    from eqx_tx.train.data import read_jsonl

    if spec == "arithmetic":
        return arithmetic_facts(), arithmetic_facts()
    examples = read_jsonl(spec, fields=("prompt",), what="prompts file")
    if not examples:
        raise ValueError(f"prompts file {spec} holds no prompts")
    return examples, examples[:64]


def _check(args: Args) -> None:
    for name in ("prompts_per_step", "n", "max_new_tokens", "save_every", "eval_every"):
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
    from eqx_tx.core.runlog import MetricsLog, write_line_chart
    from eqx_tx.infer.text import Tokenizer
    from eqx_tx.io.loading import resolve_source
    from eqx_tx.io.saving import tokenizer_files
    from eqx_tx.rl import group_advantages, rollout_batch
    from eqx_tx.train.checkpoint import has_checkpoint, restore_checkpoint, save_checkpoint
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
    config = TrainConfig(optimizer=args.optimizer,
                         policy_loss=args.policy, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)
    state = eqx_tx.init_train_state(model, config)
    del model
    os.makedirs(args.output_dir, exist_ok=True)
    checkpoint_dir = os.path.join(args.output_dir, "checkpoint")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if args.resume and has_checkpoint(checkpoint_dir):
        check_resume(checkpoint_dir, _run_metadata(args))
        state, meta = restore_checkpoint(checkpoint_dir, state)
        print(f"resumed from {checkpoint_dir} at step {meta['step']}")
    elif args.resume:
        print(f"--resume: no checkpoint in {checkpoint_dir} yet; starting at step 0")
    start = int(state.step)
    log = MetricsLog(metrics_path, start=start)  # a resumed run keeps the rows before `start`
    rollouts = Rollouts(args, tokenizer, reward, state.model, examples + eval_set)

    def evaluate(step):
        _, _, r = rollouts.sample(state.model, eval_set, seed=10**6 + step)
        return float(r.mean())

    total = args.optimizer.total_steps
    print("on-policy: one optimizer step per rollout batch, so the importance ratio is 1 up to the sampler's "
          "numerics and clip stays ~0" + ("" if args.policy.kl_coef else "; kl is not computed (--kl-coef 0)"),
          file=sys.stderr)
    bar = tqdm(range(start, total), initial=start, total=total, disable=not args.progress, desc="grpo")
    steady_tokens, steady_seconds = 0, 0.0  # sampling after the first step of this process (which compiles)
    with StopSignals() as stop:
        for step in bar:
            row = {"step": step}
            if step % args.eval_every == 0:
                row["eval_reward"] = evaluate(step)
            order = np.random.default_rng([args.seed, step]).choice(len(examples), args.prompts_per_step,
                                                                      replace=len(examples) < args.prompts_per_step)
            batch_examples = [examples[i] for i in order]
            t0 = time.perf_counter()
            prompts, gens, rewards = rollouts.sample(state.model, batch_examples, seed=step)
            sample_seconds = time.perf_counter() - t0
            batch = rollout_batch(prompts, gens, group_advantages(rewards, scale=args.scale_advantages), pad_id=eos)
            if reference is not None:
                batch = dataclasses.replace(batch, reference_logprobs=np.asarray(eqx_tx.token_logprobs(
                    reference, batch.input_ids, batch.target_ids,
                    attention_mask=np.arange(batch.input_ids.shape[1]) < batch.lengths[:, None])))
            t1 = time.perf_counter()
            state, metrics = eqx_tx.train_step(state, batch, config)
            metrics = {k: float(v) for k, v in metrics.items()}  # (waits for the step)
            train_seconds = time.perf_counter() - t1
            sampled = sum(len(g.tokens) for g in gens)
            if step > start:
                steady_tokens, steady_seconds = steady_tokens + sampled, steady_seconds + sample_seconds
            row |= {"reward": float(rewards.mean()), **metrics, "sampled_tokens": sampled,
                    "sample_seconds": sample_seconds, "train_seconds": train_seconds,
                    "sampled_tokens_per_s": sampled / max(sample_seconds, 1e-9),
                    "train_tokens_per_s": int(np.asarray(batch.lengths).sum()) / max(train_seconds, 1e-9),
                    "compiled": step == start}
            log.add(row)
            log.flush()
            steady = f"{steady_tokens / steady_seconds:,.0f}" if steady_seconds else "compiling"
            postfix = dict(reward=f"{row['reward']:.3f}", clip=f"{row['clip_fraction']:.3f}", tok_s=steady)
            if args.policy.kl_coef:
                postfix["kl"] = f"{row['kl']:.4f}"
            bar.set_postfix(postfix)
            if not args.progress and (step + 1) % 10 == 0:
                print(f"step {step + 1}: reward {row['reward']:.3f} clip {row['clip_fraction']:.3f}"
                      + (f" kl {row['kl']:.4f}" if args.policy.kl_coef else "")
                      + f" sampled tokens/s {steady} (after the first step; per step in metrics.jsonl)")
            stopping = args.stop_after is not None and step + 1 - start >= args.stop_after
            interrupted = stop.received is not None
            if (step + 1) % args.save_every == 0 or step + 1 == total or stopping or interrupted:
                save_checkpoint(checkpoint_dir, state, metadata=dict(_run_metadata(args), data_position=step + 1))
            if interrupted:
                stop.exit(step + 1, checkpoint_dir)
            if stopping:
                print(f"stopped after step {step + 1}; continue with --resume")
                return
    bar.close()
    log.add({"step": total, "eval_reward": evaluate(total)})
    log.flush()
    write_line_chart(os.path.join(args.output_dir, "reward.svg"),
                     {"per step": ("steelblue", log.series("reward")), "evaluation": ("firebrick",
                                                                             log.series("eval_reward"))},
                     title="reward", y_range=(0.0, 1.0))
    evals = log.series("eval_reward")
    print(f"evaluation reward {evals[0][1]:.3f} -> {evals[-1][1]:.3f}")
    model = state.model
    if args.lora_rank > 0:
        eqx_tx.save_adapter(model, os.path.join(args.output_dir, "adapter"), base_model_name_or_path=args.model)
        model = eqx_tx.merge_lora(model)
    eqx_tx.save(model, os.path.join(args.output_dir, "final"), extra_files=tokenizer_files(source))


if __name__ == "__main__":
    run_tool(main, Args)
