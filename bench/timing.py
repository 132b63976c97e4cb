"""The benches' one timer: a call's median wall time over repeats, after one warm-up call."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls, after one call that warms it up (caches, allocations, plans)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
