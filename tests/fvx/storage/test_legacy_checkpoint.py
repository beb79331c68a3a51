"""Checkpoints fvx 0.1 wrote still load: tests/data/legacy_run_fvx0.1 is a LoRA fine-tuning run of fvx 0.1 (4 steps,
single-process tensorstore checkpoints 2 and 4, AdamW's state one AdamWState, config classes at their old paths).
Resumed from its checkpoint 2 today, the run is the one fvx 0.1 ran, bit for bit (on a CPU whose kernels round as the
recording one's did: another computes even the first step differently); replay and export read it too."""
import pathlib
import shutil

import pytest
import torch

from fvx import run
from fvx.storage import checkpoint
from fvx.training import run_folder, tracking

from run_state import start_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
LEGACY = ROOT / "tests" / "data" / "legacy_run_fvx0.1"
EXPERIMENT = str(ROOT / "tests" / "data" / "legacy_experiment.py")  # its config, at today's import paths
COMPARED = ("loss", "grad_norm", "lr")


def restored(folder: pathlib.Path, step: int, config) -> dict:
    """Checkpoint ``step`` in ``folder`` read by today's reader into the state the config makes, by name."""
    with checkpoint.Checkpoints(folder) as checkpoints:
        state = checkpoints.restore(step, start_state(config))
    return checkpoint.leaves_by_name(state)


@pytest.fixture(scope="module")
def same_kernels(tmp_path_factory) -> bool:
    """Whether this machine computes the recorded run's first step bit for bit (its CPU's kernels round as the one
    that wrote it did); the comparisons with the recorded log are meaningless where it does not."""
    out = tmp_path_factory.mktemp("legacy_fresh") / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "1", "run.progress=false"]) == 0
    return tracking.read_scalars(out / "tb")["loss"][0] == tracking.read_scalars(LEGACY / "tb")["loss"][0]


def test_a_run_of_fvx_0_1_resumes_from_its_checkpoint_bitwise(tmp_path, capsys, same_kernels):
    if not same_kernels:
        pytest.skip("this CPU rounds fvx 0.1's first step differently from the one that recorded it")
    out = tmp_path / "resumed"
    assert run.main([EXPERIMENT, "--out", str(out), "--resume", str(LEGACY / "checkpoints" / "2")]) == 0
    assert f"resuming from {LEGACY / 'checkpoints' / '2'} (step 2)" in capsys.readouterr().out
    logged, old = tracking.read_scalars(out / "tb"), tracking.read_scalars(LEGACY / "tb")
    for name in COMPARED:
        assert logged[name] == [(s, v) for s, v in old[name] if s >= 2], name
    config = run_folder.load_run(out)
    now, then = restored(out / "checkpoints", 4, config), restored(LEGACY / "checkpoints", 4, config)
    assert now.keys() == then.keys() and any(".opt_state.2.count" in name for name in now)
    for name, tensor in now.items():
        assert torch.equal(tensor, then[name]), name


def test_replay_and_export_read_a_run_folder_of_fvx_0_1(tmp_path, capsys, same_kernels):
    folder = tmp_path / "legacy"
    shutil.copytree(LEGACY, folder)
    code = run.main(["replay", str(folder), "--step", "3"])  # from checkpoint 2, its classes at their new paths
    if same_kernels:
        assert code == 0 and "replay matches the logged step 3" in capsys.readouterr().out
    assert run.main(["export", str(folder), "--lora", "--out", str(tmp_path / "lora")]) == 0
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_a_flipped_byte_in_a_checkpoint_of_fvx_0_1_is_refused_by_name(tmp_path):
    folder = tmp_path / "checkpoints"
    shutil.copytree(LEGACY / "checkpoints", folder)
    for data in (p for p in (folder / "4" / "state").rglob("*") if p.parent.name == "d" and p.stat().st_size > 4096):
        content = bytearray(data.read_bytes())  # the array data (tensorstore keeps a copy per OCDBT level)
        content[len(content) // 2] ^= 0x10
        data.write_bytes(bytes(content))
    config = run_folder.load_run(LEGACY)
    try:
        restored(folder, 4, config)
    except checkpoint.CheckpointError as error:
        assert f"checkpoint '{folder / '4'}' is corrupt" in str(error)
    else:
        raise AssertionError("a flipped byte was restored silently")
