"""Launching gloo worker processes for the multi-process tests: a free port, and ``world`` ranks of a worker script
that saves its results to ``OUT_DIR/results.pt`` on rank 0."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(script: str | os.PathLike, out: pathlib.Path, world: int) -> dict:
    """``world`` gloo ranks of ``script OUT_DIR``, one thread each, as torchrun would start them; what rank 0 saved
    (an AssertionError with the log of a rank that failed)."""
    port, procs = free_port(), []
    for rank in range(world):
        env = {**os.environ, "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT),
               "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, str(script), str(out)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} of {world} failed:\n{log[-4000:]}"
    return torch.load(out / "results.pt", weights_only=False)
