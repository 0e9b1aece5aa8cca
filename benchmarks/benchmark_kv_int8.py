"""Quality of the int8 KV cache against the float cache, per decode step.

Greedy-decodes with the float cache, then feeds the same tokens through the decode
path with each cache and compares the logits at every step: max abs error and the
KL divergence KL(p_float || p_int8) in nats per token. Runs on the tiny random
checkpoints of the tests and, if present, on the model `tools/train.py` wrote.

    python benchmarks/benchmark_kv_int8.py
"""

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import eqx_tx
from eqx_tx.infer.generation import generate, teacher_forced_logits
from eqx_tx.infer.sampling import SamplingParams


@dataclasses.dataclass
class Args:
    trained: str = "runs/tiny/final"
    """The model tools/train.py wrote (skipped if absent)."""
    prompts: int = 8
    prompt_len: int = 48
    new_tokens: int = 64


def int8_quality(model, prompts, new_tokens: int) -> dict:
    greedy = generate(model, prompts, SamplingParams(max_new_tokens=new_tokens, stop_token_ids=()))
    continuations = [g.tokens for g in greedy]
    ref = teacher_forced_logits(model, prompts, continuations)
    quant = teacher_forced_logits(model, prompts, continuations, cache_dtype="int8")
    logp_ref, logp_q = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(quant, -1)
    kl = jnp.sum(jnp.exp(logp_ref) * (logp_ref - logp_q), -1)
    agree = jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(quant, -1))
    return dict(max_abs_logit_error=float(jnp.max(jnp.abs(ref - quant))), mean_kl=float(jnp.mean(kl)),
                max_kl=float(jnp.max(kl)), argmax_agreement=float(agree))


# Tiny random models like the tests' checkpoints (MHA tied; GQA with head_dim != hidden/heads).
RANDOM_CONFIGS = {
    "mha_tied": eqx_tx.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True),
    "gqa_untied": eqx_tx.Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gqa4_128": eqx_tx.Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128),
}


def _random_prompts(vocab, count, length, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (count, length)).tolist()


def main(args: Args) -> None:
    rows = []
    for name, config in RANDOM_CONFIGS.items():
        model = eqx_tx.init_model(config, key=jax.random.key(0))
        prompts = _random_prompts(config.vocab_size, args.prompts, args.prompt_len)
        rows.append((f"random {name}", int8_quality(model, prompts, args.new_tokens)))
    if os.path.isdir(args.trained):
        from tokenizers import Tokenizer

        model = eqx_tx.load(args.trained, progress=False)
        tok = Tokenizer.from_file(os.path.join(args.trained, "tokenizer.json"))
        from eqx_tx.train.data import TINY_STORIES, read_jsonl

        texts = [r["text"] for r in read_jsonl(TINY_STORIES)[: args.prompts]]
        prompts = [tok.encode(t).ids[: args.prompt_len] for t in texts]
        rows.append((f"trained {args.trained}", int8_quality(model, prompts, args.new_tokens)))
    else:
        print(f"({args.trained} not found: run tools/train.py to include the trained model)")
    print(f"int8 KV cache vs float cache, {args.prompts} prompts x {args.new_tokens} decode steps (greedy, fp32 model):")
    print("| model | max abs logit error | mean KL (nats/token) | max KL | argmax agreement |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['max_abs_logit_error']:.2e} | {r['mean_kl']:.2e} | {r['max_kl']:.2e} | "
              f"{100 * r['argmax_agreement']:.1f}% |")


if __name__ == "__main__":
    main(tyro.cli(Args))
