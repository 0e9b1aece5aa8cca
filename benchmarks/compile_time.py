"""Compile time does not grow with depth: the decoder layers run under one `lax.scan`.

Lowers and compiles forward+backward of the mean token loss for the same width at
2 and 24 layers, from abstract inputs (no weights), and prints the seconds.

    python benchmarks/compile_time.py
"""

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import tyro

import eqx_tx
from eqx_tx.io.loading import abstract_model
from eqx_tx.train.forward import logits_jit


@dataclasses.dataclass
class Args:
    layers: tuple[int, ...] = (2, 24)
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 32000
    batch: int = 2
    seq: int = 256


def compile_seconds(config, batch: int, seq: int) -> float:
    model = abstract_model(config, jnp.float32)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    compute = eqx_tx.ComputeConfig(attention="xla")

    def loss(model, ids, lengths):
        logits = logits_jit(model, ids, lengths, compute)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    start = time.perf_counter()
    jax.jit(jax.grad(loss)).lower(model, ids, lengths).compile()
    return time.perf_counter() - start


def main(args: Args) -> None:
    times = {}
    for n in args.layers:
        config = eqx_tx.Qwen3Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=n, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.hidden // args.heads,
        )
        compile_seconds(config, args.batch, args.seq)  # warm the tracing caches
        times[n] = compile_seconds(config, args.batch, args.seq)
        print(f"{n:3d} layers: compile {times[n]:.2f} s")
    lo, hi = min(times), max(times)
    print(f"ratio {hi} / {lo} layers: {times[hi] / times[lo]:.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
