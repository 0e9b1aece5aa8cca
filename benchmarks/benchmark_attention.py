"""Blockwise (flash) vs XLA attention on CPU: memory growth with T, and speed.

1. Memory, from compiled memory analysis of a whole-model forward+backward (a small
   Qwen3, chunked loss, per-layer checkpointing): temp bytes at T=4096 and T=16384.
   Linear attention memory grows ~4x from 4k to 16k tokens; the XLA path, which
   materialises `[heads, T, T]` scores, grows ~16x.
2. Speed: attention forward+backward (`jax.grad`) wall time at T=2048 and 8192.
3. Packed documents: a mixed-length set of documents (64 to 2048 tokens) run as
   rows packed with segment ids, as one padded row per document, as the packed rows
   without segment ids (causal over the whole row: what skipping saves), and each
   document alone (the sum): attention forward+backward, and a whole small-model
   training step (forward+backward) in real tokens per second.
4. Tiles: blockwise forward and forward+backward time per tile size (block_q x
   block_kv), the measurement behind `eqx_tx.kernels.dispatch.DEFAULT_BLOCKS`.

    python benchmarks/benchmark_attention.py
    python benchmarks/benchmark_attention.py --skip-memory --skip-speed --skip-packed   # tiles only
    python benchmarks/benchmark_attention.py --skip-memory --skip-speed --repeats 3   # packed documents only
"""

import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tyro

import eqx_tx
from eqx_tx.analysis.memory import MemoryFigures, abstract_sharded_model, compile_train_step, target_mesh
from eqx_tx.kernels.dispatch import dot_product_attention
from eqx_tx.kernels.flash import flash_attention
from eqx_tx.train.data import Examples
from eqx_tx.train.training import Batch, TrainConfig, loss_and_grads


@dataclasses.dataclass
class Args:
    memory_seq_lens: tuple[int, ...] = (4096, 16384)
    speed_seq_lens: tuple[int, ...] = (2048, 8192)
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    repeats: int = 2
    skip_memory: bool = False
    skip_speed: bool = False
    packed_row: int = 4096
    """Row length of the packed-documents comparison."""
    packed_docs: tuple[int, ...] = (2048, 1536, 1024, 768, 640, 512, 384, 320, 256, 192, 128, 128, 96, 64, 64)
    """Document lengths (tokens) of the packed-documents comparison: long-tailed, like fine-tuning data."""
    skip_packed: bool = False
    tiles: tuple[int, ...] = (128, 256, 512)
    """Square tile sizes compared (block_q = block_kv)."""
    tile_shapes: tuple[tuple[int, int], ...] = ((2, 1024), (1, 4096))
    """(batch, T) of the tile comparison."""
    skip_tiles: bool = False


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


def _median_seconds(fn, *inputs, repeats: int) -> float:
    jax.block_until_ready(fn(*inputs))  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def tile_seconds(B: int, T: int, tile: int, args: Args) -> tuple[float, float]:
    """Blockwise forward and forward+backward median seconds with `tile x tile` blocks."""
    keys = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(keys[0], (B, T, args.heads, args.head_dim))
    k, v = (jax.random.normal(key, (B, T, args.kv_heads, args.head_dim)) for key in keys[1:])

    def attention(q, k, v):
        return flash_attention(q, k, v, block_q=tile, block_kv=tile)[0]

    forward = _median_seconds(jax.jit(attention), q, k, v, repeats=args.repeats)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), argnums=(0, 1, 2)))
    return forward, _median_seconds(grads, q, k, v, repeats=args.repeats)


def _layouts(args: Args):
    """The documents as packed rows (with and without segment ids) and as padded rows."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 4096, n + 1).tolist() for n in args.packed_docs]
    packed = Examples(docs, args.packed_row, packing="segments")
    padded = Examples(docs, max(args.packed_docs), packing="pad")
    return docs, packed, padded


def packed_attention(args: Args) -> dict[str, float]:
    """Attention forward+backward seconds of each layout (blockwise kernel)."""
    _, packed, padded = _layouts(args)
    H, Hkv, K = args.heads, args.kv_heads, args.head_dim

    def run(rows: int, T: int, lengths, segments):
        key = jax.random.key(rows * 100_003 + T)
        q = jax.random.normal(key, (rows, T, H, K))
        k = jax.random.normal(jax.random.fold_in(key, 1), (rows, T, Hkv, K))
        v = jax.random.normal(jax.random.fold_in(key, 2), (rows, T, Hkv, K))

        def loss(q, k, v):
            o, _ = flash_attention(q, k, v, kv_lengths=lengths, q_segment_ids=segments, kv_segment_ids=segments)
            return jnp.sum(o)

        return _median_seconds(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, repeats=args.repeats)

    seg = jnp.asarray(packed.segment_ids)
    out = {
        "packed (segment ids)": run(len(packed), args.packed_row, jnp.asarray(packed.lengths), seg),
        "packed, no segment ids (crosses documents)": run(len(packed), args.packed_row, jnp.asarray(packed.lengths),
                                                          None),
        "padded (one document per row)": run(len(padded), padded.seq_len, jnp.asarray(padded.lengths), None),
        "each document alone (sum)": sum(run(1, n, None, None) for n in args.packed_docs),
    }
    return out


def packed_train_step(args: Args) -> dict[str, float]:
    """Whole-model forward+backward seconds, packed (segment ids) vs padded."""
    _, packed, padded = _layouts(args)
    config = eqx_tx.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                head_dim=args.head_dim)
    model = eqx_tx.init_model(config, key=jax.random.key(0))
    params, frozen = eqx.partition(model, eqx.is_array)
    train = TrainConfig(loss_chunk_size=2048, compute=eqx_tx.ComputeConfig(attention="blockwise"))
    step = jax.jit(loss_and_grads, static_argnums=4)

    def run(ex: Examples):
        b = ex.batch(0, len(ex))
        batch = Batch(*(jnp.asarray(x) for x in (b.input_ids, b.target_ids, b.loss_weights, b.lengths)),
                      segment_ids=None if b.segment_ids is None else jnp.asarray(b.segment_ids))
        count = jnp.float32(np.sum(ex.weights))
        coefficients = jnp.asarray(batch.loss_weights, jnp.float32) / count
        return _median_seconds(lambda p, f, bt: step(p, f, bt, coefficients, train, count), params, frozen, batch,
                               repeats=args.repeats)

    return {"packed (segment ids)": run(packed), "padded (one document per row)": run(padded)}


def main(args: Args) -> None:
    if not args.skip_memory:
        print("Whole-model forward+backward temp memory (compiled, CPU, B=1):")
        print("| implementation | " + " | ".join(f"T={t}" for t in args.memory_seq_lens) + " | growth |")
        print("|---" * (len(args.memory_seq_lens) + 2) + "|")
        for impl in ("blockwise", "xla"):
            temps = [model_temp_bytes(impl, t) for t in args.memory_seq_lens]
            cells = " | ".join(f"{b / 2**20:,.0f} MiB" for b in temps)
            print(f"| {impl} | {cells} | {temps[-1] / temps[0]:.1f}x |")
    if not args.skip_packed:
        _, packed, padded = _layouts(args)
        tokens = sum(args.packed_docs)
        print(f"\nPacked documents: {len(args.packed_docs)} documents, {tokens} tokens "
              f"({min(args.packed_docs)}-{max(args.packed_docs)}); packed: {len(packed)} rows of {args.packed_row} "
              f"({100 * packed.padding_fraction:.0f}% padding); padded: {len(padded)} rows of {padded.seq_len} "
              f"({100 * padded.padding_fraction:.0f}% padding). Blockwise kernel, median of {args.repeats}.")
        print("| layout | attention fwd+bwd | real tokens/s | model fwd+bwd | real tokens/s |")
        print("|---|---|---|---|---|")
        attention = packed_attention(args)
        model = packed_train_step(args)
        for name, seconds in attention.items():
            cells = f"{seconds:.3f} s | {tokens / seconds:,.0f}"
            model_cells = f"{model[name]:.3f} s | {tokens / model[name]:,.0f}" if name in model else "- | -"
            print(f"| {name} | {cells} | {model_cells} |")
    if not args.skip_tiles:
        print(f"\nBlockwise tiles: forward / forward+backward ms (causal, {args.heads} heads, {args.kv_heads} kv heads, "
              f"head_dim {args.head_dim}, {jax.default_backend()}, median of {args.repeats}):")
        print("| batch x T | " + " | ".join(f"{t} x {t}" for t in args.tiles) + " |")
        print("|---" * (len(args.tiles) + 1) + "|")
        for B, T in args.tile_shapes:
            cells = []
            for tile in args.tiles:
                fwd, both = tile_seconds(B, T, tile, args)
                cells.append(f"{1e3 * fwd:.0f} / {1e3 * both:.0f}")
            print(f"| {B} x {T} | " + " | ".join(cells) + " |")
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
