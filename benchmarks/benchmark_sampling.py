"""Top-k / top-p sampling cost per decode step: sort-free vs the sort-based reference.

Times one sampling step (`sample_batch`: filter, draw, log-probabilities) on random
logits at Qwen3's vocabulary, next to a greedy step (argmax) and the sort-based
reference (`filter_logits` per row), medians of repeats, interleaved in one process.

    python benchmarks/benchmark_sampling.py
"""

import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import tyro

from eqx_tx.sampling import SamplerArrays, SamplingParams, sample_batch, sample_token


@dataclasses.dataclass
class Args:
    vocab: int = 151936
    batches: tuple[int, ...] = (1, 16)
    repeats: int = 20
    top_k: int = 20
    top_p: float = 0.95
    temperature: float = 0.7


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
        fns = {"greedy": (jax.jit(sample_batch), greedy), "fast": (jax.jit(sample_batch), topkp),
               "sort": (jax.jit(_sort_based), topkp)}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for fn, sampler in fns.values():
            jax.block_until_ready(fn(logits, sampler, index))
        for _ in range(args.repeats):  # interleaved
            for name, (fn, sampler) in fns.items():
                t = time.perf_counter()
                jax.block_until_ready(fn(logits, sampler, index))
                times[name].append(time.perf_counter() - t)
        g, f, s = (statistics.median(times[k]) * 1e3 for k in ("greedy", "fast", "sort"))
        print(f"| {B} | {g:.2f} | {f:.2f} | {s:.2f} | {f / g:.2f}x | {f / s:.2f}x |")


if __name__ == "__main__":
    main(tyro.cli(Args))
