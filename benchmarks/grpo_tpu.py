"""`tools/grpo.py` on an accelerator with a Qwen3-0.6B-shaped model (issue 40, point 6).

Writes a random-weight bf16 checkpoint of the preset's shape with the package's tiny
tokenizer (so the run needs no download), a prompts file of `--prompts` story
openings cut to about `--prompt-tokens` tokens, then runs `tools/grpo.py` on them
(`--n` answers each, `--max-new-tokens` each, LoRA rank `--lora-rank`) for
`--steps` steps with a reward that varies between answers (`letter_share`: the share
of the letter e in the answer), and prints each step's sampling and training
tokens/s from its metrics.jsonl.

    python benchmarks/grpo_tpu.py --out /tmp/grpo
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import tyro

import eqx_tx
from eqx_tx.models.presets import preset
from eqx_tx.train.data import TINY_TOKENIZER, read_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))


def letter_share(completion: str, example: dict) -> float:
    """The reward: the share of the letter e among the answer's characters."""
    return completion.count("e") / max(len(completion), 1)


@dataclasses.dataclass(frozen=True)
class Args:
    out: str = "/tmp/grpo_tpu"
    preset: str = "qwen3-0.6b"
    prompts: int = 64
    prompt_tokens: int = 256
    prompts_per_step: int = 8
    n: int = 8
    max_new_tokens: int = 512
    lora_rank: int = 32
    steps: int = 4


def main(args: Args) -> None:
    # This process only writes the checkpoint: on the host, so that the accelerator is
    # free for tools/grpo.py (a TPU is held by one process at a time).
    jax.config.update("jax_platforms", "cpu")
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "model")
    model = eqx_tx.init_model(preset(args.preset), key=jax.random.key(0), dtype=jnp.bfloat16)
    eqx_tx.save(model, ckpt, extra_files={"tokenizer.json": TINY_TOKENIZER})
    del model
    stories = read_jsonl(os.path.join(os.path.dirname(eqx_tx.__file__), "data", "tiny_stories.jsonl"),
                         fields=("text",), what="stories")
    prompts = os.path.join(args.out, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(args.prompts):
            words = " ".join(stories[(i + j) % len(stories)]["text"] for j in range(8)).split()
            f.write(json.dumps({"prompt": " ".join(words[i % 7: i % 7 + args.prompt_tokens // 2])}) + "\n")
    run = os.path.join(args.out, "run")
    cmd = [sys.executable, os.path.join(HERE, "..", "tools", "grpo.py"), "--model", ckpt, "--output-dir", run,
           "--overwrite", "--prompts", prompts, "--reward", "grpo_tpu:letter_share",
           "--prompts-per-step", str(args.prompts_per_step), "--n", str(args.n),
           "--max-new-tokens", str(args.max_new_tokens), "--lora-rank", str(args.lora_rank),
           "--stop-after", str(args.steps), "--eval-every", "1000", "--save-every", "1000", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, env=env)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            print(json.dumps({k: row[k] for k in row if k in (
                "step", "reward", "sampled_tokens", "sample_seconds", "sampled_tokens_per_s", "train_seconds",
                "train_tokens_per_s", "compiled")}), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
