"""tinker-cookbook, unchanged, against eqx_tx's Tinker API: supervised, then RL.

Run it with the cookbook's own Python (the cookbook is a client, in its own venv, as
its users run it; `tinker-cookbook==0.5.8` installs on Python 3.11):

    python3 -m venv ../cookbook-venv && ../cookbook-venv/bin/pip install tinker-cookbook==0.5.8
    ../cookbook-venv/bin/python benchmarks/cookbook_run.py --server-python .venv/bin/python \\
        --model runs/tiny/final --out benchmarks/results/tinker_cookbook

The model is this project's arithmetic warm start (`tools/train.py --data arithmetic`:
the tiny preset trained on the 25 facts `a+b=c`, operands 0..4, written out; built first
if `--model` does not exist), the same start `tools/grpo.py` reinforces. The script
starts `tools/serve.py` (with `--server-python`: eqx_tx's environment) on it, then,
through the cookbook's own training loops (`tinker_cookbook.supervised.train`,
`tinker_cookbook.rl.train`):

1. supervised fine-tuning on a local conversation file (the facts asked, `a+b=`, and
   answered, as chats rendered by the cookbook's `role_colon` renderer);
2. RL from that checkpoint (`load_checkpoint_path`) on the cookbook's own arithmetic
   environment (`recipes/math_rl/arithmetic_env.ArithmeticEnv`, its question written
   `a+b=` and its operands 0..4): reward 1 for the right sum, minus 0.1 when the answer
   does not end with the renderer's stop sequence.

It writes the cookbook's logs under `--out` and a summary (`summary.md`): the
supervised loss and the RL reward over the steps.
"""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from functools import partial

import chz
import numpy as np

KEY = "tml-local"
MAX_OPERAND = 4


def _conversations(path: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            x, y = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{x}+{y}="},
                                             {"role": "assistant", "content": str(x + y)}]}) + "\n")


def _wait(url: str, timeout: float = 600) -> None:
    start = time.time()
    while time.time() - start < timeout:
        try:
            request = urllib.request.Request(url + "/api/v1/healthz", headers={"X-API-Key": KEY})
            urllib.request.urlopen(request, timeout=5).read()
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the server at {url} did not answer in {timeout} s")


def _metrics(log_path: str) -> list[dict]:
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _single_digit_builder():
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset, ArithmeticEnv
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
    from tinker_cookbook.rl.types import RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class Sums(ArithmeticEnv):
        """The cookbook's arithmetic environment, its question written as the facts are."""

        def get_question(self) -> str:
            return f"{self.x}+{self.y}="

    class SmallSums(ArithmeticDataset):
        """The cookbook's arithmetic dataset with operands 0..MAX_OPERAND, no few-shot prefix."""

        def _make_env_group_builder(self, rng):
            x, y = rng.randint(0, MAX_OPERAND + 1), rng.randint(0, MAX_OPERAND + 1)
            return ProblemGroupBuilder(env_thunk=partial(Sums, x, y, renderer=self.renderer),
                                       num_envs=self.group_size)

    @chz.chz
    class Builder(RLDatasetBuilder):
        batch_size: int
        group_size: int
        n_batches: int
        model_name_for_tokenizer: str
        renderer_name: str

        async def __call__(self):
            tokenizer = get_tokenizer(self.model_name_for_tokenizer)
            renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
            return SmallSums(self.batch_size, renderer, self.group_size, n_batches=self.n_batches,
                                   include_fewshot=False), None

    return Builder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-python", required=True, help="python of eqx_tx's environment (runs tools/serve.py)")
    parser.add_argument("--model", default="runs/arith/final")
    parser.add_argument("--out", default="benchmarks/results/tinker_cookbook")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--sl-epochs", type=int, default=3)
    parser.add_argument("--rl-batches", type=int, default=20)
    args = parser.parse_args()

    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.supervised import train as sl_train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model = os.path.abspath(args.model)  # served under its path: the cookbook loads the tokenizer from it
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(model):
        subprocess.run([args.server_python, os.path.join(root, "tools", "train.py"), "--data", "arithmetic",
                        "--output-dir", os.path.dirname(model), "--total-steps", "50", "--seq-len", "32",
                        "--overwrite"], check=True)
    url = f"http://127.0.0.1:{args.port}"
    os.environ["TINKER_API_KEY"] = KEY
    os.environ["TINKER_TELEMETRY"] = "0"
    server = subprocess.Popen([args.server_python, os.path.join(root, "tools", "serve.py"), "--model", model,
                               "--model-name", model, "--port", str(args.port), "--api-key", KEY,
                               "--state-dir", os.path.join(out, "server-state"), "--max-lora-rank", "16",
                               "--max-seqs", "32", "--max-tokens-in-cache", "16384", "--page-size", "16"],
                              stdout=open(os.path.join(out, "server.log"), "w"), stderr=subprocess.STDOUT)
    try:
        _wait(url)
        data = os.path.join(out, "sums.jsonl")
        _conversations(data, 512, seed=0)
        common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon",
                                                max_length=64, batch_size=32,
                                                train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
        sl_log = os.path.join(out, "sl")
        sl_config = sl_train.Config(log_path=sl_log, model_name=model, recipe_name="eqx_tx_cookbook_sl",
                                    renderer_name="role_colon",
                                    dataset_builder=FromConversationFileBuilder(common_config=common, file_path=data),
                                    learning_rate=2e-3, lr_schedule="linear", num_epochs=args.sl_epochs, lora_rank=16,
                                    base_url=url, save_every=0, eval_every=0)
        started = time.time()
        asyncio.run(sl_train.main(sl_config))
        sl_seconds = time.time() - started
        with open(os.path.join(sl_log, "checkpoints.jsonl")) as f:
            state_path = [json.loads(line) for line in f if line.strip()][-1]["state_path"]
        rl_log = os.path.join(out, "rl")
        builder = _single_digit_builder()(batch_size=16, group_size=8, n_batches=args.rl_batches,
                                          model_name_for_tokenizer=model, renderer_name="role_colon")
        rl_config = rl_train.Config(learning_rate=5e-4, dataset_builder=builder, model_name=model,
                                    recipe_name="eqx_tx_cookbook_rl", max_tokens=8, log_path=rl_log,
                                    load_checkpoint_path=state_path, renderer_name="role_colon", lora_rank=16,
                                    base_url=url, eval_every=0, save_every=0)
        started = time.time()
        asyncio.run(rl_train.main(rl_config))
        rl_seconds = time.time() - started
    finally:
        server.terminate()
        server.wait()
    sl = [m for m in _metrics(sl_log) if "train_mean_nll" in m]
    rl = [m for m in _metrics(rl_log) if "env/all/reward/total" in m]
    nll = [m["train_mean_nll"] for m in sl]
    reward = [m["env/all/reward/total"] for m in rl]
    correct = [m.get("env/all/correct", float("nan")) for m in rl]
    lines = [
        "# tinker-cookbook 0.5.8 against eqx_tx's Tinker API",
        "",
        f"Command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`",
        f"Model: `{os.path.relpath(model, root)}` (the tiny preset warmed up on the facts), LoRA rank 16, CPU.",
        "",
        f"Supervised (`tinker_cookbook.supervised.train`, {len(nll)} steps, {sl_seconds:.0f} s): mean NLL "
        f"{nll[0]:.3f} -> {nll[-1]:.3f} (first and last step; last 3 mean {np.mean(nll[-3:]):.3f}).",
        "",
        f"RL (`tinker_cookbook.rl.train`, {len(reward)} steps of 16 groups x 8, {rl_seconds:.0f} s): reward "
        f"{np.mean(reward[:3]):.3f} -> {np.mean(reward[-3:]):.3f} (mean of the first and last 3 steps); "
        f"correct {np.mean(correct[:3]):.3f} -> {np.mean(correct[-3:]):.3f}.",
        "",
        "| step | supervised NLL | RL reward | RL correct |",
        "|---|---|---|---|",
    ]
    for i in range(max(len(nll), len(reward))):
        cells = [f"{nll[i]:.3f}" if i < len(nll) else "", f"{reward[i]:.3f}" if i < len(reward) else "",
                 f"{correct[i]:.3f}" if i < len(correct) else ""]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
