"""A host allocator that keeps XLA:CPU's buffers mapped between executions.

XLA:CPU takes each execution's temporary buffer (2.3 GB for one training step of
the small benchmark model) from `malloc`, which glibc serves with a fresh `mmap`
and returns with `munmap` when the step ends. The next step faults every page in
again and the kernel zeroes it: ~570k page faults and ~1.3 s of system time in a
6.4 s step, more when other libraries in the process have fragmented the heap.

`reexec_with_retaining_malloc` restarts the current script once with glibc told to
keep freed memory (one arena, no `mmap` for large blocks, no trimming): buffers are
reused in place, the page faults go to zero, and the training step takes ~10% less
time. Freed memory then stays with the process (its resident size stays at its
peak), which is the usual trade of ML runtimes. glibc reads these settings only at
process start, hence the re-exec. The tools and the speed benchmark call it first
thing; `EQX_TX_SYSTEM_MALLOC=1` opts out, and any of the variables already set is
taken as the user's own choice and left alone.
"""

import os
import sys

RETAINING_MALLOC = {
    "MALLOC_ARENA_MAX": "1",  # worker threads share the main arena (large blocks can grow its heap)
    "MALLOC_MMAP_MAX_": "0",  # no per-block mmap: large blocks come from the heap ...
    "MALLOC_TRIM_THRESHOLD_": str(2**40),  # ... and stay there when freed
}


def retaining_malloc_active() -> bool:
    """Whether this process started with `RETAINING_MALLOC`."""
    return all(os.environ.get(k) == v for k, v in RETAINING_MALLOC.items())


def reexec_with_retaining_malloc() -> None:
    """Restart this Python process with `RETAINING_MALLOC` in its environment (Linux
    only; once; before anything else has run, as it replaces the process).

    Does nothing when already active, when `EQX_TX_SYSTEM_MALLOC` is set, or when the
    user has set any of the variables.
    """
    if sys.platform != "linux" or os.environ.get("EQX_TX_SYSTEM_MALLOC") or retaining_malloc_active():
        return
    if any(k in os.environ for k in RETAINING_MALLOC):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **RETAINING_MALLOC})
