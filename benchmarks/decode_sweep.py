"""Decode against the bandwidth roofline at each (context, batch, KV dtype): issue 40's grid.

For each `context:batch:dtype` setting (`dtype` `bf16` or `int8`): `batch` random
prompts of `context` tokens are prefilled (Qwen3-0.6B shape, random bf16 weights),
`generate`'s decode loop runs `--warm` steps, then `--steps` more are timed (one
compiled program, one call: no prefill, compilation or host work in the figure).
The roofline step reads every weight once and each row's live keys/values (mean
context over the timed steps; int8: the values and their float32 scales) at the data
sheet's bandwidth. A setting that does not fit prints so and the sweep goes on; the
sweep stops before `--budget-s`.

    python benchmarks/decode_sweep.py --settings 1024:1:bf16 1024:64:bf16 1024:64:int8 4096:16:bf16
"""

import collections
import dataclasses
import gzip
import itertools
import json
import os
import re
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from decode_batch_probe import traced
from model_flops import decode_bytes_per_token, kv_element_bytes

import eqx_tx
from eqx_tx.infer import generation
from eqx_tx.infer.sampling import SamplerArrays, SamplingParams
from eqx_tx.models.presets import preset


@dataclasses.dataclass(frozen=True)
class Args:
    settings: tuple[str, ...] = ("1024:1:bf16", "1024:64:bf16", "1024:64:int8")
    """`context:batch:dtype` triples (`dtype`: the KV cache's, `bf16` or `int8`)."""
    preset: str = "qwen3-0.6b"
    attentions: tuple[str, ...] = ("auto",)
    """`ComputeConfig.attention` settings, each setting measured with each."""
    n: int = 1
    """Samples per prompt: `batch / n` prompts, each sampled `n` times; with `n > 1` the
    samples share their prompt's cache (`SharedPrefixCache`), and the roofline reads a
    prompt's keys/values once."""
    tokens_per_step: tuple[int, ...] = (0,)
    """The decode kernel's tokens per grid step (`ComputeConfig.decode_tokens_per_step`
    and `decode_int8_tokens_per_step` both), each setting measured at each; 0: the
    library's defaults."""
    warm: int = 8
    steps: int = 64
    bandwidth_gbs: float = 819.0
    """The roofline's bandwidth (TPU v5e data sheet)."""
    budget_s: float = 540.0
    """Skip the settings left once this many seconds have passed."""
    profile_dir: str | None = None
    """Also trace one more timed call per setting with `jax.profiler` here, and report
    its device ops that took the most time (ms per decode step) and their time by kind
    (the op's name without its number); the trace and the decode program's HLO are left
    there (`perfetto_*.json.gz`, `decode_*.hlo.txt.gz`)."""
    temperature: float = 0.0
    """Every sequence's `SamplingParams.temperature` (0: greedy, no random numbers)."""


def measure(model, cfg, context: int, batch: int, dtype: str, attention: str, tokens_per_step: int, args: Args,
            rng) -> dict:
    compute = eqx_tx.ComputeConfig(attention=attention)  # type: ignore[arg-type]
    if tokens_per_step:
        compute = dataclasses.replace(compute, decode_tokens_per_step=tokens_per_step,
                                      decode_int8_tokens_per_step=tokens_per_step)
    tokens_per_step = compute.decode_step_tokens(dtype == "int8")
    if batch % args.n:
        raise ValueError(f"batch {batch} is not a multiple of --n {args.n}")
    prompts = rng.integers(0, cfg.vocab_size, (batch // args.n, context)).tolist()
    timed = args.steps * (1 if args.profile_dir is None else 2)  # the traced call decodes after the timed one
    params = [SamplingParams(max_new_tokens=args.warm + timed + 1, stop_token_ids=(),
                             temperature=args.temperature)] * len(prompts)
    plan, seq_params, samples = generation.plan_requests(prompts, params, args.n, True, None)
    sampler = SamplerArrays.from_params(seq_params, cfg.eos_token_ids, cfg.vocab_size, samples)
    t = time.perf_counter()
    state = generation.prefill_state(model, plan, None if dtype == "bf16" else "int8", compute)
    state = generation.decode(model, state, sampler, jnp.asarray(args.warm, jnp.int32), compute=compute)
    jax.block_until_ready(state)
    first_s = time.perf_counter() - t
    t = time.perf_counter()
    state = generation.decode(model, state, sampler, jnp.asarray(args.steps, jnp.int32), compute=compute)
    jax.block_until_ready(state)
    step_ms = 1e3 * (time.perf_counter() - t) / args.steps
    assert int(state.step) == args.warm + args.steps
    profile = {}
    if args.profile_dir is not None:
        name = f"{context}_{batch}_{dtype}_{tokens_per_step}_t{args.temperature:g}"
        path, top = traced(os.path.join(args.profile_dir, f"trace_{name}"),
                           lambda: jax.block_until_ready(generation.decode(
                               model, state, sampler, jnp.asarray(args.steps, jnp.int32), compute=compute)), 10_000)
        if path is not None:
            shutil.copy(path, os.path.join(args.profile_dir, f"perfetto_{name}.json.gz"))
            per_step = [(op, ms / args.steps) for op, ms in top]
            profile["top_device_ops_ms_per_step"] = [(op, round(ms, 4)) for op, ms in per_step[:25]]
            kinds = collections.Counter()
            for op, ms in per_step:
                if not op.startswith(("jit_", "while")):  # the program and its loop hold the rest
                    kinds[re.sub(r"[.\d]+$", "", op)] += ms
            profile["ms_per_step_by_kind"] = {k: round(v, 4) for k, v in kinds.most_common(30)}
        hlo = generation.decode.lower(model, state, sampler, jnp.asarray(args.steps, jnp.int32),
                                      compute=compute).compile().as_text()
        with gzip.open(os.path.join(args.profile_dir, f"decode_{name}.hlo.txt.gz"), "wt") as f:
            f.write(hlo)
    live = (batch // args.n) * context + batch * (args.warm + args.steps / 2)  # a shared prompt's keys once
    step_bytes = decode_bytes_per_token(cfg, 2, kv_length=live,
                                        kv_bytes=kv_element_bytes(cfg.head_dim, dtype))
    roofline_ms = 1e3 * step_bytes / (args.bandwidth_gbs * 1e9)
    return {"context": context, "batch": batch, "n": args.n, "kv": dtype, "attention": attention,
            "tokens_per_step": tokens_per_step,
            "step_ms": round(step_ms, 3), "roofline_ms": round(roofline_ms, 3),
            "of_roofline": f"{roofline_ms / step_ms:.0%}", "tokens_per_s": round(batch / step_ms * 1e3),
            "first_call_s": round(first_s, 1), **profile}


def main(args: Args) -> None:
    eqx_tx.enable_console_logging()
    start = time.perf_counter()
    cfg = preset(args.preset)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    for setting, attention, tokens_per_step in itertools.product(args.settings, args.attentions,
                                                                 args.tokens_per_step):
        context, batch, dtype = setting.split(":")
        if dtype not in ("bf16", "int8"):
            raise ValueError(f"setting {setting!r}: the KV dtype is bf16 or int8, not {dtype!r}")
        if time.perf_counter() - start > args.budget_s:
            print(json.dumps({"setting": setting, "skipped": f"over the {args.budget_s:.0f} s budget"}), flush=True)
            continue
        try:
            row = measure(model, cfg, int(context), int(batch), dtype, attention, tokens_per_step, args, rng)
        except Exception as e:  # RESOURCE_EXHAUSTED (does not fit), or a kernel that does not compile
            row = {"setting": setting, "attention": attention, "tokens_per_step": tokens_per_step,
                   "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
