"""Interleaved timing for the benchmarks: on a shared, noisy machine only figures
measured side by side in one run compare."""

import statistics
import time
from collections.abc import Callable


def median_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Warm each callable up once, then time them interleaved (`repeats` rounds of
    one call each); the median seconds of each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}
