"""Benchmark: fvx.core.random.normal against torch.randn, eager and inside a compiled function.

    python bench/random.py [--device cpu|cuda] [--repeats 20] [--threads N]

Rows: the pure-op eager sampler (what the fast path avoids), fvx's default eager path (compiled sampler above
FAST_PATH_MIN_NUMEL), a draw inside a user's torch.compile(fullgraph=True) function, and torch.randn inside one. Every
time is divided by eager torch.randn measured in the same rounds (calls interleaved).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

# Replace this script's folder (whose random.py would shadow the standard library's) with the repository root.
sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
from fvx.core import random  # noqa: E402


def median_seconds(fns, device: torch.device, repeats: int) -> list[float]:
    """Median wall time of each fn() over ``repeats`` rounds, calls interleaved so that load drift hits all alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:  # warm-up: compiles happen here
        fn(), fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            fn_times.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def cases(n: int, key: torch.Tensor, device: torch.device):
    """(label, draw of n standard normals); the first is the baseline, eager torch.randn."""
    compiled_fvx = torch.compile(lambda k: random.normal(k, (n,)), fullgraph=True)
    compiled_randn = torch.compile(lambda: torch.randn(n, device=device), fullgraph=True)
    return [
        ("torch.randn, eager (baseline)", lambda: torch.randn(n, device=device)),
        ("fvx eager, pure ops", lambda: random._normal_flat(key, n, torch.float32)),
        ("fvx eager, default (fast path)", lambda: random.normal(key, (n,))),
        ("fvx inside torch.compile", lambda: compiled_fvx(key)),
        ("torch.randn inside torch.compile", compiled_randn),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch's default if unset)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    key = random.key(0, device=device)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} CPU threads, "
          f"fast path from {random.FAST_PATH_MIN_NUMEL} elements, median of {args.repeats}")
    header = f"{'samples':>9}  {'draw':<34}{'ms':>9}{'/ randn':>9}"
    print(header)
    print("-" * len(header))
    for n in (1 << 20, 1 << 22):
        labels, draws = zip(*cases(n, key, device))
        seconds = median_seconds(draws, device, args.repeats)
        for label, s in zip(labels, seconds):
            print(f"{n:>9}  {label:<34}{s * 1e3:>9.2f}{s / seconds[0]:>9.2f}")


if __name__ == "__main__":
    main()
