"""Issue 40's capacity: the largest `generate` batch that fits on one device, against its bound.

For each `prompt:new:dtype` setting (Qwen3-0.6B shape, random bf16 weights, KV cache
`bf16` or `int8`): a batch of `prompt`-token prompts is prefilled (in chunks of
`--prefill-chunk`) into a cache sized for `prompt + new` tokens, and two decode steps
run: the programs and buffers of the whole call, at their full size (the cache is
allocated whole; later steps use no more memory).

The bound is `(device limit - weights - workspace) / bytes per sequence`: the
allocator's `bytes_limit`, the weights' bytes, the larger temporary size of the
compiled prefill and decode programs (XLA's `memory_analysis`, measured at the batch
tried), and the decode state's bytes over its batch (cache, logits, tokens,
log-probs). A first run at `--probe-batch` gives the first bound; the bound's batch is
tried, then `--shrink` times smaller until one fits (at most `--tries`). Printed: the
largest batch that ran, the bound measured there, and their ratio (issue 40 asks for
90% or more).

    python benchmarks/capacity.py --settings 2048:2048:bf16 2048:2048:int8 4096:4096:bf16 4096:4096:int8
"""

import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import eqx_tx
from eqx_tx.infer import generation
from eqx_tx.infer.sampling import SamplerArrays, SamplingParams
from eqx_tx.models.presets import preset


@dataclasses.dataclass(frozen=True)
class Args:
    settings: tuple[str, ...] = ("2048:2048:bf16", "2048:2048:int8", "4096:4096:bf16", "4096:4096:int8")
    """`prompt:new:dtype` triples (`dtype`: the KV cache's, `bf16` or `int8`)."""
    preset: str = "qwen3-0.6b"
    prefill_chunk: int = 512
    probe_batch: int = 8
    shrink: float = 0.97
    tries: int = 5
    limit_gib: float | None = None
    """The device's memory (default: its allocator's `bytes_limit`; give it on a CPU)."""


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def attempt(model, cfg, prompt: int, new: int, dtype: str, batch: int, args: Args) -> dict:
    """Prefill `batch` prompts and decode two steps; the bytes measured on the way.
    Raises what the allocator raises when it does not fit."""
    compute = eqx_tx.ComputeConfig()
    cache_dtype = None if dtype == "bf16" else "int8"
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt)).tolist()
    params = [SamplingParams(max_new_tokens=new, stop_token_ids=())] * batch
    plan, seq_params, samples = generation.plan_requests(prompts, params, 1, False, args.prefill_chunk)
    cache = jax.eval_shape(lambda: generation.cache_for(model, plan.P, plan.cache_len, cache_dtype))
    tokens, lengths = jnp.asarray(plan.tokens), jnp.asarray(plan.lengths)
    prefill_temp = generation.prefill.lower(model, cache, tokens, lengths, chunk=plan.chunk, compute=compute).compile(
    ).memory_analysis().temp_size_in_bytes
    sampler = SamplerArrays.from_params(seq_params, cfg.eos_token_ids, cfg.vocab_size, samples)
    state = generation.prefill_state(model, plan, cache_dtype, compute)
    steps = jnp.asarray(2, jnp.int32)
    decode_temp = generation.decode.lower(model, state, sampler, steps, compute=compute).compile(
    ).memory_analysis().temp_size_in_bytes
    per_sequence = nbytes(state) / batch
    state = generation.decode(model, state, sampler, steps, compute=compute)
    jax.block_until_ready(state)
    del state
    return {"per_sequence": per_sequence, "workspace": max(prefill_temp, decode_temp), "cache_len": plan.cache_len}


def main(args: Args) -> None:
    eqx_tx.enable_console_logging()
    cfg = preset(args.preset)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    if args.limit_gib is not None:
        limit = int(args.limit_gib * 2**30)
    else:
        stats = jax.devices()[0].memory_stats()
        if not stats or "bytes_limit" not in stats:
            raise SystemExit(f"{jax.devices()[0].platform} reports no memory limit: give --limit-gib")
        limit = stats["bytes_limit"]
    weights = nbytes(model)
    for setting in args.settings:
        prompt, new, dtype = setting.split(":")
        if dtype not in ("bf16", "int8"):
            raise ValueError(f"setting {setting!r}: the KV dtype is bf16 or int8, not {dtype!r}")
        prompt, new = int(prompt), int(new)

        def bound(m: dict) -> int:
            return math.floor((limit - weights - m["workspace"]) / m["per_sequence"])

        t = time.perf_counter()
        probe = attempt(model, cfg, prompt, new, dtype, args.probe_batch, args)
        batch, fit, tried = bound(probe), None, []
        for _ in range(args.tries):
            try:
                fit = (batch, attempt(model, cfg, prompt, new, dtype, batch, args))
                tried.append((batch, "ran"))
                break
            except Exception as e:  # RESOURCE_EXHAUSTED: does not fit
                tried.append((batch, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                batch = math.floor(batch * args.shrink)
        row = {"prompt": prompt, "new": new, "kv": dtype, "limit_gib": round(limit / 2**30, 2),
               "weights_gib": round(weights / 2**30, 3), "first_bound": bound(probe), "tried": tried,
               "seconds": round(time.perf_counter() - t, 1)}
        if fit is not None:
            largest, measured = fit
            row.update(largest_batch=largest, bound=bound(measured), of_bound=f"{largest / bound(measured):.0%}",
                       per_sequence_mib=round(measured["per_sequence"] / 2**20, 2),
                       workspace_gib=round(measured["workspace"] / 2**30, 3), cache_len=measured["cache_len"])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
