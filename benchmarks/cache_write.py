"""A dense cache's prefill writes, as windows against token by token, in one process.

`KVCache.write` writes a row of at least `eqx_tx.cache.dense.WINDOW_TOKENS` tokens as
one window, fewer token by token. This compiles `prefill` of `B` prompts of `T`
tokens (random weights of a preset's shape, one chunk) both ways, by moving that
threshold before each trace, and times the two programs interleaved: on a TPU v5e the
token-by-token writes were 116 of 671 ms of a 4 x 8192 prefill
(`benchmarks/results/accelerator_tpu_v5e.md`, stop 51).

    python benchmarks/cache_write.py                                  # CPU, the tiny preset
    python benchmarks/cache_write.py --preset qwen3-0.6b --batch 4 --prompt 8192 --dtype bfloat16
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from timing import median_times

import eqx_tx
from eqx_tx.cache import dense
from eqx_tx.infer.generation import cache_for, prefill
from eqx_tx.models.presets import preset


@dataclasses.dataclass
class Args:
    preset: str = "tiny"
    batch: int = 4
    prompt: int = 1024
    dtype: str = "float32"
    """The weights' and the cache's dtype."""
    repeats: int = 7


def main(args: Args) -> None:
    cfg = preset(args.preset)
    dtype = jnp.dtype(args.dtype)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=dtype)
    B, T = args.batch, args.prompt
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    lengths = jnp.full((B,), T, jnp.int32)
    compiled, default = {}, dense.WINDOW_TOKENS
    try:
        for name, threshold in (("windows", 1), ("token by token", T + 1)):
            dense.WINDOW_TOKENS = threshold  # read when `write` is traced
            run = jax.jit(functools.partial(prefill.__wrapped__, chunk=T, compute=eqx_tx.ComputeConfig()),
                          donate_argnums=1)
            compiled[name] = run.lower(model, cache_for(model, B, T, dtype), tokens, lengths).compile()
    finally:
        dense.WINDOW_TOKENS = default

    def call(name):
        cache = jax.block_until_ready(cache_for(model, B, T, dtype))  # (its allocation is not timed apart)
        jax.block_until_ready(compiled[name](model, cache, tokens, lengths))

    times = median_times({name: functools.partial(call, name) for name in compiled}, args.repeats)
    print(f"prefill of {B} x {T} tokens, {args.preset}, {args.dtype}, on {jax.devices()[0].device_kind}; "
          f"median of {args.repeats}, interleaved")
    for name, seconds in times.items():
        print(f"| {name} | {1e3 * seconds:,.1f} ms |")
    print(f"token by token / windows: {times['token by token'] / times['windows']:.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args))
