"""Measurement helpers shared by the benchmarks: peak memory of a step, medians of alternating timings."""
from __future__ import annotations

import resource
import statistics
import time
from typing import Callable


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """The highest resident memory this process has had (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    """Seconds one call of ``fn`` takes, with ``sync`` before and after (a CUDA synchronize on GPUs)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
              sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, run in turn (a, b, a, b, ...) so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, sync))
    return {name: statistics.median(ts) for name, ts in times.items()}
