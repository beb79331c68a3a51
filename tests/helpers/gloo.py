"""What the multi-process tests share: a free port, ``world`` gloo ranks of a worker script that saves its results to
``OUT_DIR/results.pt`` on rank 0, ``fvx.run`` on 2 gloo processes beside one, and the closeness they are held to."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import torch

from cli_args import merged
from fvx import run

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


EXPERIMENT = str(ROOT / "experiments" / "finetune_wan.py")
QUICK = ["--steps", "3", "run.progress=false", "data.batch_size=4", "data.prefetch=1", "method.optim.warmup_steps=1",
         "run.checkpoint.every=0", "run.checkpoint.final=false", "validation.every=0"]  # no-grad sampling: a 2nd graph
COMPARED = ("loss", "grad_norm", "lr")
REL = 1e-6  # fp32: 2 processes differ from one only in reduction order


def launch2(out: pathlib.Path, *overrides: str, experiment: str = EXPERIMENT, expect: int = 0) -> list[str]:
    """``fvx.run`` on 2 gloo processes, as torchrun would start them; each rank's output (its exit code is
    ``expect``)."""
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, "-m", "fvx.run", experiment, "--out", str(out),
                                       *merged(*QUICK, *overrides)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate()[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == expect, f"rank {rank}:\n{text}"
    if expect == 0:
        assert "done: 3 steps" in outputs[0] and "(2 processes)" in outputs[0]
        assert "done:" not in outputs[1]  # only rank 0 reports
    return outputs


def launch1(out: pathlib.Path, *overrides: str, experiment: str = EXPERIMENT) -> None:
    assert run.main([experiment, "--out", str(out), *merged(*QUICK, *overrides)]) == 0


def assert_two_processes_log_as_one(tmp_path: pathlib.Path, experiment: str, knobs: tuple[str, ...],
                                    metrics: tuple[str, ...], abs_tol: float = 1e-7) -> None:
    """``experiment`` with ``knobs`` on 2 gloo processes and on 1: each of ``metrics`` the same at every step within
    1e-5 relative (the ranks' reductions add in another order)."""
    import pytest

    from fvx.training import tracking

    launch2(tmp_path / "two", *knobs, experiment=experiment)
    launch1(tmp_path / "one", *knobs, experiment=experiment)
    two, one = (tracking.read_scalars(tmp_path / name / "tb") for name in ("two", "one"))
    for name in metrics:
        assert len(two[name]) == len(one[name]) > 0, name
        for (_, got), (_, want) in zip(two[name], one[name]):
            assert got == pytest.approx(want, rel=1e-5, abs=abs_tol), (name, two[name], one[name])



def assert_close_rel(got: dict, want: dict, rel: float = REL):
    """Every element within ``rel`` of the largest magnitude in ``want``, and every tensor within ``10 rel`` in norm.
    (Per-element relative errors are meaningless for gradients that are zero up to rounding, such as the key biases
    of attention, which softmax ignores.)"""
    assert list(got) == list(want)
    scale = max(w.abs().max() for w in want.values())
    for name in want:
        err = (got[name] - want[name]).abs().max() / scale
        norm_err = (got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)
        assert err <= rel and norm_err <= 10 * rel, f"{name}: error {err:.2e} of the largest, {norm_err:.2e} in norm"
