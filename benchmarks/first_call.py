"""The first `generate` call's compile time, beside the second call's run time.

`--batch` random prompts of `--prompt` tokens and `--new` new tokens each (no stop
token), Qwen3-0.6B shape, random bf16 weights: the first call's seconds, the XLA
compilations inside it (count and seconds, `core.log.compile_times`), then a second
identical call, and a third with prompts `--grow` tokens longer (does a longer
prompt compile again?).

    python benchmarks/first_call.py --batch 16 --prompt 2048 --new 2048
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import eqx_tx
from eqx_tx.core.log import compile_times
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.models.presets import preset


@dataclasses.dataclass(frozen=True)
class Args:
    preset: str = "qwen3-0.6b"
    batch: int = 16
    prompt: int = 2048
    new: int = 2048
    grow: int = 100
    cache_dtype: str | None = None


def main(args: Args) -> None:
    eqx_tx.enable_console_logging()
    cfg = preset(args.preset)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=args.new, stop_token_ids=())
    for call, length in (("first", args.prompt), ("second", args.prompt), ("longer prompt", args.prompt + args.grow)):
        prompts = rng.integers(0, cfg.vocab_size, (args.batch, length)).tolist()
        with compile_times() as compiles:
            t = time.perf_counter()
            out = eqx_tx.generate(model, prompts, params, cache_dtype=args.cache_dtype)
            seconds = time.perf_counter() - t
        assert all(len(g.tokens) == args.new for g in out)
        print(json.dumps({"call": call, "batch": args.batch, "prompt": length, "new": args.new,
                          "seconds": round(seconds, 1), "compilations": len(compiles),
                          "compile_s": round(sum(compiles), 1)}), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
