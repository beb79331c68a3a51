"""One rank of the sharded-load test: build a Wan model from a diffusers folder on a 2-process mesh, measure this
process's peak resident memory while its params load, and write its local shards (safetensors) and the peak (JSON).
    WORLD_SIZE=2 RANK=r ... python tests/helpers/load_worker.py FOLDER OUT"""
from __future__ import annotations

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file

from fvx.core import random
from fvx.distributed import processes, sharding
from fvx_models import wan
from fvx_models.family import Preset

PRESET = "test-load-4x1024"  # 64M params, 256 MB in fp32: big enough to see a per-rank load


def register() -> None:
    wan.PRESETS[PRESET] = Preset({**wan.TINY, "num_layers": 4, "num_attention_heads": 8, "attention_head_dim": 128,
                                  "ffn_dim": 4096, "text_dim": 64}, wan.TINY_VAE, 16,
                                 wan.PRESETS["tiny"].options)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(folder: str, out: str) -> None:
    register()
    d = processes.init_distributed()
    mesh = processes.make_mesh()
    model = wan.WanConfig(preset=PRESET, path=folder).build(mesh=mesh)
    before = rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    params = model.weights.initial(random.key(0))
    peak = peak_rss_bytes() - before
    save_file({name: t.contiguous() for name, t in params.items()}, f"{out}/rank{d.rank}.safetensors")
    pathlib.Path(f"{out}/rank{d.rank}.json").write_text(json.dumps({"peak": peak, "local": sharding.local_bytes(params)}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
