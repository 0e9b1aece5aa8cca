"""On a TPU: the decode kernel alone, a decode step's 28 layers of it, against the bytes it reads.

For each `batch:live:dtype` setting (`dtype` `bf16` or `int8`) a Qwen3-0.6B-shaped page
pool (28 layers, pages of `--pages` tokens, 8 kv heads of 128, 16 query heads) holds random
keys and values (int8: random values and float32 scales per token and kv head), each
sequence `live` tokens on shuffled pages. One jitted program runs
`decode_attention_blocks` over the 28 layers; the median of `--repeats` calls is
reported beside the live keys and values it reads (int8: and their scales) at the data
sheet's bandwidth. No weights, no cache writes: what the kernel costs a decode step.

    python benchmarks/decode_kernel_time.py --settings 64:1100:bf16 64:1100:int8 --tokens-per-step 128 512

`--pages 128 256 512` sets the block each DMA moves (a page of the engine's pool; a dense
cache's `DENSE_BLOCK`): fewer, larger DMAs per grid step, more dead slots at a sequence's end.

`--modules` times other copies of the kernel beside it, interleaved in one process (an
earlier commit's, to compare on the chip):

    git show 05d3b05:eqx_tx/kernels/decode_tpu.py > eqx_tx/kernels/decode_tpu_05d3b05.py
    python benchmarks/decode_kernel_time.py --modules eqx_tx.kernels.decode_tpu eqx_tx.kernels.decode_tpu_05d3b05

A module from before the int8 scales were stored in rows of 128 (one with
`_scale_rows`) is handed the same scales in its layout, `[layers, pages, kv_heads,
page_size]`.
"""

import dataclasses
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from timing import median_times

from eqx_tx.kernels.quantized import scales_by_token, stored_scales

LAYERS, KV_HEADS, HEAD_DIM, HEADS = 28, 8, 128, 16


@dataclasses.dataclass(frozen=True)
class Args:
    settings: tuple[str, ...] = ("64:1100:bf16", "64:1100:int8", "32:4200:bf16", "32:4200:int8")
    """`batch:live:dtype` triples (`dtype`: the cache's, `bf16` or `int8`)."""
    tokens_per_step: tuple[int, ...] = (128, 512)
    """The kernel's tokens per grid step, each setting measured at each."""
    pages: tuple[int, ...] = (128,)
    """Tokens per page (per block the kernel DMAs), each setting measured at each."""
    repeats: int = 10
    modules: tuple[str, ...] = ("eqx_tx.kernels.decode_tpu",)
    """Modules whose `decode_attention_blocks` is timed, interleaved (copies of the
    kernel's module, e.g. an earlier commit's, inside `eqx_tx.kernels`)."""
    bandwidth_gbs: float = 819.0
    """The roofline's bandwidth (TPU v5e data sheet)."""


def pool(batch: int, live: int, dtype: str, page: int, rng):
    """A page pool holding `batch` sequences of `live` tokens on shuffled pages, their
    tables, lengths and queries (int8 values drawn on the host: drawing them on the
    device takes int32 temporaries four times their size)."""
    per_seq = -(-live // page)
    shape = (LAYERS, batch * per_seq + 1, page, KV_HEADS, HEAD_DIM)
    scales = None
    if dtype == "int8":
        k, v = (jax.device_put(rng.integers(-127, 128, shape, dtype=np.int8)) for _ in range(2))
        by_token = (LAYERS, shape[1], page, KV_HEADS)
        scales = tuple(stored_scales(jax.device_put(rng.uniform(1e-3, 3e-2, by_token).astype(np.float32)))
                       for _ in range(2))
    else:
        keys = jax.random.split(jax.random.key(batch), 2)
        k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    table = jnp.asarray(rng.permutation(batch * per_seq).reshape(batch, per_seq), jnp.int32)
    lengths = jnp.full((batch,), live, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, HEAD_DIM)), jnp.bfloat16)
    return q, k, v, table, lengths, scales


def step_ms(q, k, v, table, lengths, scales, *, modules: tuple[str, ...], tokens_per_step: int,
            repeats: int) -> dict[str, float]:
    """Median ms of one program running each module's kernel over every layer."""

    def program(kernel):
        @jax.jit
        def layers(q, k, v, table, lengths, scales):
            def body(layer, acc):
                out = kernel(q, k, v, layer, table, lengths, scales=scales, tokens_per_step=tokens_per_step,
                             interpret=False)
                return acc + out.astype(jnp.float32)

            return jax.lax.fori_loop(0, LAYERS, body, jnp.zeros(q.shape, jnp.float32))

        compiled = layers.lower(q, k, v, table, lengths, scales).compile()
        return lambda: jax.block_until_ready(compiled(q, k, v, table, lengths, scales))

    def kernel(name):
        module = importlib.import_module(name)
        if scales is not None and hasattr(module, "_scale_rows"):  # heads-major scales, tokens-minor
            heads_major = tuple(jnp.swapaxes(scales_by_token(x, k.shape[2], KV_HEADS), -1, -2) for x in scales)
            return lambda q, k, v, layer, table, lengths, scales, **kw: module.decode_attention_blocks(
                q, k, v, layer, table, lengths, scales=heads_major, **kw)
        return module.decode_attention_blocks

    calls = {name: program(kernel(name)) for name in modules}
    return {name: 1e3 * seconds for name, seconds in median_times(calls, repeats).items()}


def main(args: Args) -> None:
    if jax.default_backend() != "tpu":
        raise SystemExit(f"decode_kernel_time compiles the kernel with Mosaic: it needs a TPU "
                         f"(backend is {jax.default_backend()})")
    rng = np.random.default_rng(0)
    for setting in args.settings:
        batch, live, dtype = setting.split(":")
        if dtype not in ("bf16", "int8"):
            raise ValueError(f"setting {setting!r}: the cache dtype is bf16 or int8, not {dtype!r}")
        batch, live = int(batch), int(live)
        element = 1 if dtype == "int8" else 2
        read = 2 * LAYERS * batch * live * KV_HEADS * (HEAD_DIM * element + (4 if dtype == "int8" else 0))
        for page in args.pages:
            data = pool(batch, live, dtype, page, rng)
            for tokens_per_step in args.tokens_per_step:
                times = step_ms(*data, modules=args.modules, tokens_per_step=tokens_per_step, repeats=args.repeats)
                for module, ms in times.items():
                    print(json.dumps({"batch": batch, "live": live, "kv": dtype, "page": page,
                                      "tokens_per_step": tokens_per_step,
                                      **({"module": module} if len(times) > 1 else {}),
                                      "ms": round(ms, 3), "GB_per_s": round(read / ms / 1e6, 1),
                                      "of_bandwidth": f"{read / ms / 1e6 / args.bandwidth_gbs:.0%}"}), flush=True)
            del data


if __name__ == "__main__":
    main(tyro.cli(Args))
