"""A bf16 KV cache against a float32 one on CPU, in one process: ms per decode step of
`generate` (a dense cache) and of the `Engine` (a page pool), the same model in each
dtype. XLA:CPU has no bf16 arithmetic; a cache stored as bf16 was converted whole to
float32 and back on each write (and on each paged read), so its steps cost time in
proportion to the cache's size, not to what they read (`eqx_tx.cache.storage`).

    python benchmarks/cpu_bf16_cache.py
"""

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import eqx_tx
from eqx_tx import SamplingParams
from eqx_tx.infer import generation
from eqx_tx.infer.sampling import SamplerArrays
from eqx_tx.models.presets import preset


@dataclasses.dataclass
class Args:
    preset: str = "tiny"
    batch: int = 4
    prompt: int = 1800
    """`generate`'s prompt length (its cache holds it and the new tokens)."""
    steps: int = 32
    """`generate`'s decode steps per timed call."""
    pool_tokens: int = 65536
    """The engine's page pool (its requests hold only `batch * 128` tokens of it)."""
    repeats: int = 5


def generate_step_ms(model, cfg, args: Args) -> float:
    """`generate`'s decode loop alone (its prefill done first): the median over repeats
    of `steps` decode steps, per step."""
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    params = [SamplingParams(max_new_tokens=(args.repeats + 1) * args.steps + 1, stop_token_ids=())] * args.batch
    plan, sequence_params, samples = generation.plan_requests(prompts, params, 1, False, None)
    sampler = SamplerArrays.from_params(sequence_params, cfg.eos_token_ids, cfg.vocab_size, samples)
    compute = eqx_tx.ComputeConfig()
    state = generation.prefill_state(model, plan, None, compute)
    steps = jnp.asarray(args.steps, jnp.int32)
    state = jax.block_until_ready(generation.decode(model, state, sampler, steps, compute=compute))  # compile
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        state = jax.block_until_ready(generation.decode(model, state, sampler, steps, compute=compute))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)) / args.steps


def engine_step_ms(model, cfg, args: Args) -> float:
    engine = eqx_tx.Engine(model, max_seqs=args.batch, max_tokens_in_cache=args.pool_tokens, page_size=16)
    requests = [(np.random.default_rng(i).integers(0, cfg.vocab_size, 64).tolist(),
                 SamplingParams(max_new_tokens=64, stop_token_ids=())) for i in range(args.batch)]
    engine.run(requests)  # compile
    for prompt, params in requests:
        engine.add(prompt, params)
    times = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main(args: Args) -> None:
    cfg = preset(args.preset)
    rows = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=dtype)
        rows[jnp.dtype(dtype).name] = {"generate_ms": round(generate_step_ms(model, cfg, args), 2),
                                       "engine_ms": round(engine_step_ms(model, cfg, args), 2)}
    for name in ("generate_ms", "engine_ms"):
        rows[f"bf16 / f32 {name[:-3]}"] = round(rows["bfloat16"][name] / rows["float32"][name], 2)
    print(rows)


if __name__ == "__main__":
    main(tyro.cli(Args))
