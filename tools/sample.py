"""Sample from a model with a KV cache, streaming the text as it is generated.

With no arguments: samples from `runs/tiny/final`, the model the default
`python tools/train.py` run writes.

    python tools/sample.py
    python tools/sample.py --model Qwen/Qwen3-0.6B --chat --prompt "Hello" --tp 8

Sampling settings default to the checkpoint's generation_config.json (as Hugging Face
uses them); each flag given overrides its setting, and the run prints what it used.
"""

import dataclasses
import os
import sys
import time
from typing import Annotated, Literal

import tyro

from eqx_tx.cli import run_tool
from eqx_tx.core.compute import AttentionImpl
from eqx_tx.core.distributed import DistributedArgs

DEFAULT_MODEL = "runs/tiny/final"


@dataclasses.dataclass
class Args:
    model: str = DEFAULT_MODEL
    """An HF checkpoint directory (e.g. what tools/train.py writes) or a hub repo id."""
    prompt: Annotated[list[str], tyro.conf.UseAppendAction] = dataclasses.field(default_factory=list)
    """A prompt; repeat the flag for several (sampled as one batch). Default: "Once upon a time,"."""
    prompts_file: str | None = None
    """A file of prompts: one per line, or jsonl with a 'prompt' or 'text' field, or a 'messages' chat
    (overrides --prompt)."""
    chat: bool = False
    """Render each prompt as a user message with the checkpoint's chat template ('messages' records always are)."""
    max_new_tokens: int | None = None
    """Stop each sample after this many new tokens (default: generation_config.json's, else 64)."""
    temperature: float | None = None
    """0 is greedy; otherwise logits are divided by it (default: generation_config.json's, else 0.8)."""
    top_k: int | None = None
    """Keep the k most likely tokens, 0: all (default: generation_config.json's, else 0)."""
    top_p: float | None = None
    """Keep the smallest set of most likely tokens whose probability reaches p, 1.0: all (default:
    generation_config.json's, else 0.95)."""
    seed: int = 0
    """Seed of the first prompt; prompt i uses seed + i."""
    stop_token_ids: tuple[int, ...] | None = None
    """Stop tokens (default: generation_config.json's eos_token_id, else the model's)."""
    tp: int = 1
    """Tensor-parallel size."""
    prefill_chunk_size: int | None = None
    """Prefill this many prompt positions at a time (default: the whole prompt)."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    """KV-cache storage (int8: per-token, per-head scales; about half of bf16)."""
    n: int = 1
    """Samples per prompt; the prompt's KV is stored once for all of them."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype (auto: the checkpoint's)."""
    attention: AttentionImpl = "auto"
    """Attention kernel (see eqx_tx.ComputeConfig)."""
    stream_every: int = 8
    """Decode steps between streamed updates."""
    distributed: Annotated[DistributedArgs, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=DistributedArgs
    )
    """Multi-host: --coordinator-address, --num-processes, --process-id (or JAX_* env vars).
    Every process reads the same prompts; the batch is split over the data-parallel
    groups and process 0 prints the results in the original order."""


# Used where neither a flag nor the checkpoint's generation_config.json sets a value.
FALLBACK = dict(max_new_tokens=64, temperature=0.8, top_k=0, top_p=0.95)
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop_token_ids")


def sampling_settings(args: Args, defaults) -> tuple[dict, str]:
    """Each sampling setting from its flag, else the checkpoint's `defaults` (a
    `SamplingParams` or None), else `FALLBACK`; and a line saying where each came from."""
    settings, origin = {}, {}
    for name in SAMPLING_FLAGS:
        if getattr(args, name) is not None:
            settings[name], origin[name] = getattr(args, name), "flag"
        elif defaults is not None and (name != "stop_token_ids" or defaults.stop_token_ids is not None):
            settings[name], origin[name] = getattr(defaults, name), "generation_config.json"
        elif name in FALLBACK:
            settings[name], origin[name] = FALLBACK[name], "default"
        else:
            settings[name], origin[name] = None, "model eos"
    line = "sampling: " + ", ".join(f"{k}={settings[k]} ({origin[k]})" for k in SAMPLING_FLAGS)
    return settings, line


def read_prompts(args: Args) -> list[str | list[dict]]:
    """Texts, or chats (lists of messages) from 'messages' records."""
    if args.prompts_file is None:
        return list(args.prompt) or ["Once upon a time,"]
    from eqx_tx.train.data import read_jsonl

    if args.prompts_file.endswith(".jsonl"):
        records = read_jsonl(args.prompts_file, fields=("prompt", "text", "messages"), what="prompts file")
        return [r["messages"] if "messages" in r else r.get("prompt", r.get("text")) for r in records]
    if not os.path.isfile(args.prompts_file):
        raise FileNotFoundError(f"prompts file {args.prompts_file} does not exist")
    with open(args.prompts_file) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {args.prompts_file} has no prompts")
    return prompts


def main(args: Args) -> None:
    if args.model == DEFAULT_MODEL and not os.path.isdir(DEFAULT_MODEL):
        raise FileNotFoundError(
            f"no model at {DEFAULT_MODEL}: create it with `python tools/train.py` (about a minute), "
            "or pass --model"
        )
    from eqx_tx.core.distributed import initialize, is_main_process

    initialize(args.distributed)  # before anything touches a device
    import jax
    import jax.numpy as jnp

    import eqx_tx
    from eqx_tx.core.log import compile_times
    from eqx_tx.infer.generation import generate
    from eqx_tx.infer.steps import check_requests

    eqx_tx.enable_console_logging()
    from eqx_tx.infer.sampling import SamplingParams
    from eqx_tx.io.loading import resolve_source

    prompts = read_prompts(args)
    directory = resolve_source(args.model)
    tokenizer = eqx_tx.load_tokenizer(directory)
    settings, used = sampling_settings(args, tokenizer.sampling_defaults())
    dtypes = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}
    mesh = eqx_tx.make_mesh(tp=args.tp) if args.tp > 1 or jax.process_count() > 1 else None
    main_process = is_main_process()
    model = eqx_tx.load(directory, dtype=dtypes[args.dtype], mesh=mesh, progress=False)
    params = [SamplingParams(seed=args.seed + i, **settings) for i in range(len(prompts))]
    if main_process:
        print(used, file=sys.stderr)
    ids = [tokenizer.encode_prompt(p, chat=args.chat) for p in prompts]  # 'messages' records are chats
    shown_prompts = [p if isinstance(p, str) else tokenizer.decode(i, skip_special_tokens=False)
                     for p, i in zip(prompts, ids)]
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    sequences = [p for p in shown_prompts for _ in range(args.n)]  # generate's order: prompt-major
    labels = [f"{i // args.n}" if args.n == 1 else f"{i // args.n}.{i % args.n}" for i in range(len(sequences))]
    produced = [[] for _ in sequences]
    shown = ["" for _ in sequences]
    stops = set(settings["stop_token_ids"] or model.config.eos_token_ids)

    first_update = []

    def on_tokens(new):
        if not first_update:
            first_update.append((time.perf_counter(), sum(len(t) for t in new)))
        for i, toks in enumerate(new):
            produced[i].extend(toks)
            text = tokenizer.decode([t for t in produced[i] if t not in stops])
            delta, shown[i] = text[len(shown[i]) :], text
            if delta and main_process:
                prefix = "" if len(sequences) == 1 else f"[{labels[i]}] "
                sys.stdout.write(prefix + delta + ("" if len(sequences) == 1 else "\n"))
        sys.stdout.flush()

    # Bad requests (a prompt past the model's positions, ...) fail here, before any output.
    check_requests(model.config, ids, params, args.n, args.prefill_chunk_size)
    if len(sequences) == 1 and main_process:
        sys.stdout.write(sequences[0])
    start = time.perf_counter()
    with compile_times() as compile_seconds:
        results = generate(
            model, ids, params,
            n=args.n,
            prefill_chunk_size=args.prefill_chunk_size,
            cache_dtype=dtypes[args.kv_cache_dtype],
            compute=eqx_tx.ComputeConfig(attention=args.attention),
            stream_every=args.stream_every,
            on_tokens=on_tokens,
        )
    elapsed = time.perf_counter() - start
    if not main_process:
        return
    print()
    if len(sequences) > 1:
        for i, (p, r) in enumerate(zip(sequences, results)):
            print(f"--- [{labels[i]}] ({r.stop_reason}) {p}{shown[i]}")
    end = time.perf_counter()
    total = sum(len(r.tokens) for r in results)
    compiling = sum(compile_seconds)
    report = (f"{total} tokens in {elapsed:.2f} s: compilation {compiling:.2f} s (once per shape), prefill and the "
              f"first {first_update[0][1]} tokens {first_update[0][0] - start - compiling:.2f} s")
    later = total - first_update[0][1]
    if later > 0:
        report += f", then {later} tokens at {later / (end - first_update[0][0]):.1f} tokens/s"
    print(report, file=sys.stderr)


if __name__ == "__main__":
    run_tool(main, Args)
