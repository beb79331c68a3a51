"""A sharded model loads without a full copy per rank: each rank reads its own slices of the safetensors files."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fvx.core import random
from fvx.distributed import sharding
from fvx_models import diffusers_folder as dfolder, wan

import load_worker  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # writes a 256 MB model and loads it in 2 processes
def test_each_rank_reads_only_its_slices_and_they_equal_the_full_load(tmp_path):
    load_worker.register()
    model = wan.WanConfig(preset=load_worker.PRESET).build()
    model.export.folder(model.weights.init(random.key(0)), str(tmp_path / "model"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(pathlib.Path(load_worker.__file__)), str(tmp_path / "model"),
                               str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": str(ROOT)}) for rank in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    skeleton = wan.WAN.architecture.skeleton(wan.WanConfig(preset=load_worker.PRESET))
    full = dfolder.read_params(tmp_path / "model", skeleton, wan.WAN.checkpoints.components, "test")
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    layout = sharding.plan({n: tuple(t.shape) for n, t in full.items()}, 2)
    for rank in range(2):
        local = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        for name, tensor in full.items():
            assert torch.equal(local[name], sharding.local_slice(tensor, layout[name], rank, 2)), name
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["local"] <= full_bytes / 2 + 4096
        assert record["peak"] < full_bytes / 2 + 48 * 2**20, (record, full_bytes)  # never a full copy per rank
