"""`eqx_tx.analysis.host_memory`: the retaining allocator removes XLA:CPU's per-execution page faults."""

import os
import subprocess
import sys

import pytest

# Runs a jitted program with three 16 MiB temporaries (two matmul operands and its
# product; the result is a scalar) and reports the minor page faults of executions
# 3 to 7 together (the first ones may still grow the heap, e.g. under load).
SCRIPT = """
import resource
from eqx_tx.analysis.host_memory import reexec_with_retaining_malloc, retaining_malloc_active
reexec_with_retaining_malloc()
import jax, jax.numpy as jnp
step = jax.jit(lambda x: jnp.sum(jnp.outer(x, x) @ jnp.outer(x + 1.0, x)))
x = jnp.linspace(0.0, 1.0, 2048)
step(x).block_until_ready()
step(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step(x).block_until_ready()
print(retaining_malloc_active(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
BUFFER_PAGES = 2048 * 2048 * 4 // 4096  # one 16 MiB buffer in 4 KiB pages


def _run(**env) -> tuple[bool, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "EQX_TX_SYSTEM_MALLOC"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**environ, "JAX_PLATFORMS": "cpu", **env},
                         capture_output=True, text=True, timeout=300, check=True)
    active, faults = out.stdout.split()
    return active == "True", int(faults)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc settings")
def test_retaining_malloc_reuses_buffers_without_page_faults():
    active, faults = _run()
    assert active
    assert faults < 2 * BUFFER_PAGES  # 15 buffers allocated; at most a late heap growth faults
    # Without retention glibc maps and faults the temporaries in again at every execution: its
    # default does so for buffers above its dynamic mmap threshold (up to 32 MiB); pinned at 1 MiB
    # here, so that 16 MiB buffers always are.
    active, faults = _run(EQX_TX_SYSTEM_MALLOC="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
    assert not active
    assert faults > 10 * BUFFER_PAGES
