"""Does vLLM load the PEFT adapters eqx_tx exports (`eqx_tx.save_adapter`, which the
Tinker API's `save_weights_for_sampler` writes) and apply them as eqx_tx does?

A tiny random Qwen3 checkpoint (transformers), a rank-8 LoRA on every projection with
random A and B, written by `save_adapter`; `vllm_adapter_load.py` runs in a Python
that has vLLM (its own venv: vLLM pins its own torch) and loads the directory with
vLLM's LoRA loader, then scores tokens with the deltas it loaded. Printed: the
largest difference from eqx_tx's log-probs of the same tokens (float32).

    python benchmarks/vllm_adapter.py --vllm-python ../vllm-venv/bin/python
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import equinox as eqx
import jax
import numpy as np
import torch
import transformers
import tyro

import eqx_tx
from eqx_tx.infer.prompt_scores import prompt_scores
from eqx_tx.layers.lora import lora_filter


@dataclasses.dataclass(frozen=True)
class Args:
    vllm_python: str = "../vllm-venv/bin/python"
    """A Python with vLLM installed."""
    rank: int = 8
    alpha: float = 16.0
    out: str | None = None
    """Append the result as JSON to this file."""


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          tie_word_embeddings=False, max_position_embeddings=256)
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(config).save_pretrained(base)
        model = eqx_tx.apply_lora(eqx_tx.load(base, progress=False), rank=args.rank, alpha=args.alpha,
                                  key=jax.random.key(1))
        lora, rest = eqx.partition(model, lora_filter(model))
        leaves, tree = jax.tree.flatten(lora)
        keys = jax.random.split(jax.random.key(2), len(leaves))
        lora = jax.tree.unflatten(tree, [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
        model = eqx.combine(lora, rest)  # A and B both random: every delta non-zero
        adapter = os.path.join(tmp, "adapter")
        eqx_tx.save_adapter(model, adapter, base_model_name_or_path=base)
        tokens = np.random.default_rng(0).integers(0, 128, 48).tolist()
        want = prompt_scores(model, tokens)[0]
        with open(os.path.join(tmp, "tokens.json"), "w") as f:
            json.dump({"tokens": tokens}, f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_adapter_load.py")
        done = subprocess.run([args.vllm_python, script, adapter, base, os.path.join(tmp, "tokens.json")],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"vLLM side failed:\n{done.stderr[-4000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        diff = float(np.abs(np.asarray(got.pop("logprobs")) - want).max())
        base_diff = float(np.abs(prompt_scores(eqx_tx.merge_lora(model), tokens)[0] - want).max())
        version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
        result = {"vllm": version, **got, "max_abs_logprob_diff_vs_eqx_tx": diff,
                  "eqx_tx_merged_vs_unmerged": base_diff, "tokens": len(tokens) - 1}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
        if diff > 1e-3:
            sys.exit(f"vLLM's adapter differs from eqx_tx's by {diff}")


if __name__ == "__main__":
    main(tyro.cli(Args))
