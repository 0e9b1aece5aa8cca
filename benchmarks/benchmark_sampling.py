"""Top-k / top-p sampling cost per decode step: sort-free vs the sort-based reference.

Times one sampling step (`sample_batch`: filter, draw, log-probabilities) on random
logits at Qwen3's vocabulary, next to a greedy step (argmax) and the sort-based
reference (`filter_logits` per row), medians of repeats, interleaved in one process.
Then the whole decode step of `generate` (the benchmark_speed model: hidden 512, 8
layers, tied head at the same vocabulary), greedy vs top-k/top-p: a step is the time of
`decode_tokens` new tokens less the time of one, over `decode_tokens - 1`.

    python benchmarks/benchmark_sampling.py
"""

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from timing import median_times

import eqx_tx
from eqx_tx.analysis.host_memory import reexec_with_retaining_malloc
from eqx_tx.infer.sampling import SamplerArrays, SamplingParams, sample_batch, sample_token
from eqx_tx.train.forward import init_model


@dataclasses.dataclass
class Args:
    vocab: int = 151936
    batches: tuple[int, ...] = (1, 16)
    repeats: int = 20
    top_k: int = 20
    top_p: float = 0.95
    temperature: float = 0.7
    decode_tokens: int = 64
    decode_repeats: int = 7
    """Repeats of the whole-decode-step comparison (0: skip it)."""


def _sort_based(logits, sampler, index):
    """The reference path: sort every row (`sample_token`), same keys and draws."""
    tokens = jax.vmap(sample_token)(logits, sampler.temperature, sampler.top_k, sampler.top_p, sampler.keys(index))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def main(args: Args) -> None:
    print(f"One sampling step, V={args.vocab}, top_k={args.top_k}, top_p={args.top_p}, "
          f"temperature={args.temperature}; median of {args.repeats} (ms)")
    print("| batch | greedy | sort-free top-k/top-p | sort-based reference | sort-free / greedy | sort-free / sort |")
    print("|---|---|---|---|---|---|")
    for B in args.batches:
        logits = jax.random.normal(jax.random.key(B), (B, args.vocab)) * 3
        index = jnp.zeros((B,), jnp.int32)
        greedy = SamplerArrays.from_params([SamplingParams()] * B, (), args.vocab)
        topkp = SamplerArrays.from_params([SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                                          top_p=args.top_p, seed=i) for i in range(B)],
                                          (), args.vocab)
        steps = {"greedy": (jax.jit(sample_batch), greedy), "fast": (jax.jit(sample_batch), topkp),
                 "sort": (jax.jit(_sort_based), topkp)}
        t = median_times({name: lambda fn=fn, sampler=sampler: jax.block_until_ready(fn(logits, sampler, index))
                          for name, (fn, sampler) in steps.items()}, args.repeats)
        g, f, s = (t[k] * 1e3 for k in ("greedy", "fast", "sort"))
        print(f"| {B} | {g:.2f} | {f:.2f} | {s:.2f} | {f / g:.2f}x | {f / s:.2f}x |")
    if args.decode_repeats:
        decode_steps(args)


def decode_steps(args: Args) -> None:
    config = eqx_tx.Qwen3Config(vocab_size=args.vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                max_position_embeddings=4096, tie_word_embeddings=True)
    model = init_model(config, key=jax.random.key(0))
    sampled = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=1)
    n = args.decode_tokens
    print(f"\nThe whole decode step of generate (hidden 512, 8 layers, tied head, V={args.vocab}; {n} tokens after "
          f"128), median of {args.decode_repeats} (ms)")
    print("| batch | greedy step | top-k/top-p step | top-k/top-p / greedy |")
    print("|---|---|---|---|")
    for B in args.batches:
        prompts = np.random.default_rng(B).integers(0, args.vocab, (B, 128)).tolist()
        fns = {}
        for label, kw in (("greedy", {}), ("sampled", sampled)):
            for tokens in (n, 1):
                params = SamplingParams(max_new_tokens=tokens, stop_token_ids=(), **kw)
                fns[f"{label}_{tokens}"] = lambda p=params: eqx_tx.generate(model, prompts, p)
        t = median_times(fns, args.decode_repeats)
        g, f = ((t[f"{w}_{n}"] - t[f"{w}_1"]) / (n - 1) * 1e3 for w in ("greedy", "sampled"))
        print(f"| {B} | {g:.2f} | {f:.2f} | {f / g:.2f}x |")


if __name__ == "__main__":
    reexec_with_retaining_malloc()
    main(tyro.cli(Args))
