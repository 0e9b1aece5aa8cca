"""One decode step's int8 scale write on the CPU: `put_scale_rows` (whole rows of 128
lanes) against an older writer, interleaved in one process: stop 55's `put_scales` (a
window of each token's heads), or stop 56's `put_scale_rows` (its lanes placed by a
gather).

Batch 64, a 4,096-token cache of 8 kv heads; microseconds per write of one layer's
scale buffer (a decode step makes two per layer), the median of `--rounds` rounds of
200 writes. The old function is read from a file that git writes:

    git show 3438863:eqx_tx/cache/storage.py > /tmp/old_storage.py
    python benchmarks/scale_write_cpu.py --old /tmp/old_storage.py
    git show 26bc93b:eqx_tx/cache/storage.py > /tmp/rows_storage.py
    python benchmarks/scale_write_cpu.py --old /tmp/rows_storage.py --old-function put_scale_rows
"""

import dataclasses
import importlib.util
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqx_tx.cache import storage
from eqx_tx.cache.allocate import new_cache


@dataclasses.dataclass(frozen=True)
class Args:
    old: str = "/tmp/old_storage.py"
    """`eqx_tx/cache/storage.py` as of an earlier commit."""
    old_function: str = "put_scales"
    """The old file's writer: `put_scales` (stop 55) or `put_scale_rows` (stop 56)."""
    batch: int = 64
    tokens: int = 4096
    rounds: int = 5


class _Shape:
    num_hidden_layers, num_key_value_heads, head_dim = 4, 8, 128


def main(args: Args) -> None:
    spec = importlib.util.spec_from_file_location("eqx_tx.cache.old_storage", args.old)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    B, L = args.batch, args.tokens
    scales = new_cache(_Shape(), B, L, "int8").k_scale
    x = jnp.ones((B, 1, _Shape.num_key_value_heads), jnp.float32)
    lead = (jnp.asarray(1), jnp.arange(B)[:, None])
    if args.old_function == "put_scales":
        def old_write(b, p):
            return old.put_scales(b, lead, p, x)
    else:
        def old_write(b, p):
            return old.put_scale_rows(b, lead, p, x, L)
    writes = {"put_scale_rows": jax.jit(lambda b, p: storage.put_scale_rows(b, lead, p, x, L), donate_argnums=0),
              f"{args.old_function} (old)": jax.jit(old_write, donate_argnums=0)}
    positions = [jnp.full((B, 1), L // 4 + i, jnp.int32) for i in range(200)]
    times = {name: [] for name in writes}
    for _ in range(args.rounds):
        for name, write in writes.items():
            buf = write(jnp.zeros_like(scales), positions[0])
            jax.block_until_ready(buf)
            t = time.perf_counter()
            for p in positions:
                buf = write(buf, p)
            jax.block_until_ready(buf)
            times[name].append((time.perf_counter() - t) / 200 * 1e6)
    for name, ts in times.items():
        print(f"{name}: {np.median(ts):.1f} us per write (rounds: {', '.join(f'{t:.0f}' for t in ts)})")


if __name__ == "__main__":
    main(tyro.cli(Args))
