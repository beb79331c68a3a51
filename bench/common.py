"""Measurement helpers shared by the benchmarks: peak memory of a step, medians of alternating timings, a free
port for the ranks a benchmark launches."""
from __future__ import annotations

import resource
import socket
import statistics
import time
from typing import Callable


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """The highest resident memory this process has had (Linux ``VmHWM``), since :func:`reset_peak_rss` if called.
    Not ``ru_maxrss``: after fork + exec that also holds the parent's resident size at the fork."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (peak memory needs Linux)")


def reset_peak_rss() -> None:
    """Lower this process's peak resident memory to its current value (Linux >= 4.0, ``/proc/self/clear_refs``), so
    that :func:`peak_rss_bytes` measures from here on (past setup and compilation, say)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (MASTER_PORT for launched ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet() -> None:
    """No loading bars or dtype warnings from diffusers and transformers in a report."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
