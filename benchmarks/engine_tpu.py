"""The engine on an accelerator: generated tokens/s of `--requests` requests through
`eqx_tx.Engine`, for each attention setting, page size, pool dtype and step layout
(`--mixed-steps`: a step's prefill chunk and decode rows in one pass, or not),
beside the bandwidth roofline.

Qwen3-0.6B shape, random bf16 weights; every request has a `--prompt`-token random
prompt and `--new` new tokens (greedy, no stop token); `--max-seqs` slots and a pool
that holds them all. One run compiles (`Engine.warmup` and a first run), the next is
timed. The roofline is the decode steps' alone: `requests * new` tokens in steps of
`max_seqs` rows, each step reading every weight once and the rows' live keys/values
(mean context `prompt + new / 2`) at the data sheet's 819 GB/s; the measured time
includes the prefill, so the share is a lower bound.

    python benchmarks/engine_tpu.py --attentions auto xla --page-sizes 16 128
    python benchmarks/engine_tpu.py --attentions auto --page-sizes 128 --mixed-steps False True
"""

import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from model_flops import decode_bytes_per_token, kv_element_bytes

import eqx_tx
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.models.presets import preset


@dataclasses.dataclass(frozen=True)
class Args:
    preset: str = "qwen3-0.6b"
    requests: int = 64
    max_seqs: int = 64
    prompt: int = 512
    new: int = 256
    attentions: tuple[str, ...] = ("auto", "xla")
    page_sizes: tuple[int, ...] = (16, 128)
    kv_dtypes: tuple[str, ...] = ("bf16",)
    """The pool's dtypes: `bf16` or `int8`."""
    mixed_steps: tuple[bool, ...] = (False,)
    """`EngineConfig.mixed_steps` settings to run."""
    bandwidth_gbs: float = 819.0


def timed_run(engine, requests, cfg, kv: str, args: Args) -> dict:
    """Step the engine through `requests`, timing every step (stepped one by one, the
    steps alone, not the statistics read between them, while which the device idles;
    overlapped (`EngineConfig.overlap_steps`), the statistics too: the device runs the
    step in flight meanwhile). Returns the whole run's
    generated tokens/s and its decode-only steps' (those that ran no prefill chunk)
    tokens/s and share of their own roofline (each step's rows and the keys/values they
    held before it, every weight read once per step)."""
    for prompt, params in requests:
        engine.add(prompt, params)
    generated, decode_s, decode_tokens, decode_bytes, seconds = 0, 0.0, 0, 0.0, 0.0
    while engine.has_work():
        t = time.perf_counter()
        held = engine.stats()["tokens_held"]  # counted page by page
        ran = engine.scheduler.prefill_chunks
        counted = time.perf_counter()
        events = engine.step()  # host tokens (of the step before it, with overlap_steps)
        dt = time.perf_counter() - (t if engine.config.overlap_steps else counted)
        seconds += dt
        generated += len(events)
        if engine.scheduler.prefill_chunks == ran and events:  # a step that ran no prefill chunk
            decode_s += dt
            decode_tokens += len(events)
            decode_bytes += decode_bytes_per_token(cfg, 2, kv_length=held, kv_bytes=kv_element_bytes(cfg.head_dim, kv))
    for i in list(engine.scheduler.finished):
        engine.result(i)
    return {"tokens_per_s": round(generated / seconds), "seconds": round(seconds, 2),
            "decode_only_tokens_per_s": round(decode_tokens / max(decode_s, 1e-9)),
            "decode_only_share_of_time": f"{decode_s / seconds:.0%}",
            "decode_only_of_roofline": f"{decode_bytes / (args.bandwidth_gbs * 1e9) / max(decode_s, 1e-9):.0%}"}


def main(args: Args) -> None:
    eqx_tx.enable_console_logging()
    cfg = preset(args.preset)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, cfg.vocab_size, args.prompt).tolist(),
                 SamplingParams(max_new_tokens=args.new, stop_token_ids=())) for _ in range(args.requests)]
    rows = min(args.max_seqs, args.requests)
    for attention, page, kv, mixed in itertools.product(args.attentions, args.page_sizes, args.kv_dtypes,
                                                        args.mixed_steps):
        step_s = decode_bytes_per_token(cfg, 2, kv_length=rows * (args.prompt + args.new / 2),
                                        kv_bytes=kv_element_bytes(cfg.head_dim, kv)) / (args.bandwidth_gbs * 1e9)
        roofline = rows / step_s
        engine = eqx_tx.Engine(model, max_seqs=args.max_seqs, page_size=page, max_seq_len=args.prompt + args.new,
                               max_tokens_in_cache=rows * (args.prompt + args.new + page),
                               cache_dtype=jnp.int8 if kv == "int8" else None, mixed_steps=mixed,
                               compute=eqx_tx.ComputeConfig(attention=attention))  # type: ignore[arg-type]
        t = time.perf_counter()
        engine.warmup()
        engine.run(requests)
        compile_s = time.perf_counter() - t
        row = {"attention": attention, "page_size": page, "kv": kv, "mixed_steps": mixed, "requests": args.requests,
               "max_seqs": args.max_seqs, "prompt": args.prompt, "new": args.new,
               **timed_run(engine, requests, cfg, kv, args), "first_run_s": round(compile_s, 1)}
        row["decode_roofline_tokens_per_s"] = round(roofline)
        row["of_roofline"] = f"{row['tokens_per_s'] / roofline:.0%}"
        print(json.dumps(row), flush=True)
        del engine  # its pool, before the next engine allocates one


if __name__ == "__main__":
    main(tyro.cli(Args))
