"""Blockwise (flash) vs XLA attention on CPU: memory growth with T, and speed.

1. Memory, from compiled memory analysis of a whole-model forward+backward (a small
   Qwen3, chunked loss, per-layer checkpointing): temp bytes at T=4096 and T=16384.
   Linear attention memory grows ~4x from 4k to 16k tokens; the XLA path, which
   materialises `[heads, T, T]` scores, grows ~16x.
2. Speed: attention forward+backward (`jax.grad`) wall time at T=2048 and 8192.

    python benchmarks/benchmark_attention.py
"""

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import tyro

import eqx_tx
from eqx_tx.kernels.dispatch import dot_product_attention
from eqx_tx.memory import MemoryFigures, abstract_sharded_model, compile_train_step, target_mesh
from eqx_tx.training import TrainConfig


@dataclasses.dataclass
class Args:
    memory_seq_lens: tuple[int, ...] = (4096, 16384)
    speed_seq_lens: tuple[int, ...] = (2048, 8192)
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    repeats: int = 2
    skip_speed: bool = False


def model_temp_bytes(implementation: str, seq_len: int) -> int:
    # A small vocabulary and loss chunk, so the LM head does not hide the attention's share.
    config = eqx_tx.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    mesh = target_mesh("cpu", tp=1)
    model = abstract_sharded_model(config, mesh, jnp.float32)
    train = TrainConfig(loss_chunk_size=1024, compute=eqx_tx.ComputeConfig(attention=implementation, remat="full"))
    return MemoryFigures.of(compile_train_step(model, mesh, 1, seq_len, train)).temp


def attention_seconds(implementation: str, T: int, args: Args) -> float:
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, T, args.heads, args.head_dim))
    k = jax.random.normal(kk, (1, T, args.kv_heads, args.head_dim))
    v = jax.random.normal(kv, (1, T, args.kv_heads, args.head_dim))

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, implementation=implementation))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))  # compile
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t)
    return min(times)


def main(args: Args) -> None:
    print("Whole-model forward+backward temp memory (compiled, CPU, B=1):")
    print("| implementation | " + " | ".join(f"T={t}" for t in args.memory_seq_lens) + " | growth |")
    print("|---" * (len(args.memory_seq_lens) + 2) + "|")
    for impl in ("blockwise", "xla"):
        temps = [model_temp_bytes(impl, t) for t in args.memory_seq_lens]
        cells = " | ".join(f"{b / 2**20:,.0f} MiB" for b in temps)
        print(f"| {impl} | {cells} | {temps[-1] / temps[0]:.1f}x |")
    if args.skip_speed:
        return
    print(f"\nAttention forward+backward time (causal, B=1, {args.heads} heads, {args.kv_heads} kv heads, "
          f"head_dim {args.head_dim}, best of {args.repeats}):")
    print("| implementation | " + " | ".join(f"T={t}" for t in args.speed_seq_lens) + " |")
    print("|---" * (len(args.speed_seq_lens) + 1) + "|")
    for impl in ("blockwise", "xla"):
        cells = " | ".join(f"{attention_seconds(impl, t, args):.3f} s" for t in args.speed_seq_lens)
        print(f"| {impl} | {cells} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
