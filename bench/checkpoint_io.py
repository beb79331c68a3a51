"""Benchmark: fvx's checkpoint save and restore of a training state against writing and reading the same tensors with
safetensors alone, measured in the same run.

    python bench/checkpoint_io.py [--mb 1200] [--repeats 3]

The state is a one-role fine-tuning state of ``--mb`` MB (params, AdamW's moments and counts, an EMA: 4 tensors per
param). Rows, median of ``--repeats`` rounds, each in a fresh folder: ``save sync`` (a committed checkpoint: pieces,
CRCs, fsync, commit marker), ``save async (blocking)`` (what the training loop waits for: the host copy), ``save async
(total)`` (until committed), ``restore`` (into a target state, every piece checked against its CRC); the peer is
``safetensors.torch.save_file`` + ``fsync`` of the same flat dict, and ``load_file`` of it (every tensor read).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fvx.core import optim, random, tree  # noqa: E402
from fvx.core.state import RoleState, TrainState  # noqa: E402
from fvx.storage.checkpoint import Checkpoints  # noqa: E402
from fvx.storage.checkpoint_config import CheckpointConfig  # noqa: E402


def make_state(mb: int) -> TrainState:
    """A fine-tuning state of about ``mb`` MB: 16 params of equal size, AdamW's state and an EMA."""
    numel = mb * 2**20 // 4 // 4 // 16
    keys = random.split(random.key(0), 16)
    params = {f"blocks.{i}.weight": random.normal(keys[i], (numel // 256, 256)) for i in range(16)}
    tx = optim.adamw(1e-3)
    return TrainState(torch.tensor(3), random.key(1), {"student": RoleState(
        params, tx.init(params), tree.map_tensors(torch.clone, params))})


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fvx_round(state: TrainState, target: TrainState, folder: pathlib.Path) -> dict[str, float]:
    out = {}
    with Checkpoints(folder / "sync", CheckpointConfig(async_save=False)) as checkpoints:
        out["save sync"] = timed(lambda: checkpoints.save(state, config={}, meta={}))
    with Checkpoints(folder / "async", CheckpointConfig(async_save=True)) as checkpoints:
        began = time.perf_counter()
        checkpoints.save(state, config={}, meta={})
        out["save async (blocking)"] = time.perf_counter() - began
        checkpoints.wait()
        out["save async (total)"] = time.perf_counter() - began
    with Checkpoints(folder / "sync") as checkpoints:
        out["restore"] = timed(lambda: checkpoints.restore(3, target))
    return out


def peer_round(state: TrainState, folder: pathlib.Path) -> dict[str, float]:
    flat = {name.replace(".", "/"): t for name, t in ((".".join(p), t) for p, t in tree.named_leaves(state))}
    path = folder / "peer.safetensors"

    def save() -> None:
        save_file(flat, str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def load() -> None:
        {name: t.clone() for name, t in load_file(str(path)).items()}  # read every byte, as a restore does

    return {"save": timed(save), "load": timed(load)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    state, target = make_state(args.mb), make_state(args.mb)
    size = sum(t.numel() * t.element_size() for t in tree.tensor_leaves(state)) / 2**20
    rows, peers = [], []
    for _ in range(args.repeats):
        folder = pathlib.Path(tempfile.mkdtemp(prefix="fvx-bench-"))
        try:
            rows.append(fvx_round(state, target, folder))
            peers.append(peer_round(state, folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    peer = {name: statistics.median(p[name] for p in peers) for name in peers[0]}
    print(f"checkpoint of a {size:.0f} MB state, median of {args.repeats} (peer: safetensors save_file + fsync "
          f"{peer['save']:.3f} s, load_file {peer['load']:.3f} s)")
    for name in rows[0]:
        seconds = statistics.median(r[name] for r in rows)
        against = peer["load"] if name == "restore" else peer["save"]
        print(f"  {name:<24}{seconds:8.3f} s  {seconds / against:6.2f}x the peer")


if __name__ == "__main__":
    main()
