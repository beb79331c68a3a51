"""Launching fvx.run: a 2-process (gloo) fine-tuning run logs the losses of one process and holds half the state per
rank, and its sharded checkpoints resume on one process; ``--dry-run`` prints per-role bytes per rank from shapes
alone; compiled blocks are counted in the logs."""
import math
import pathlib

import pytest
import torch

from fvx import run
from fvx.distributed import memory
from fvx.storage import checkpoint
from fvx.training import dry_run, resume, run_folder, tracking
from fvx_models import wan

from run_state import start_state  # noqa: E402
from gloo import COMPARED, EXPERIMENT, QUICK, REL, launch1, launch2  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.slow  # 2 + 1 processes of DMD2 and of Self-Forcing
@pytest.mark.parametrize("experiment, knobs", [
    ("dmd2.py:world_lora", ("method.generator_update_interval=2",)),
    ("self_forcing_causal_t2v.py", ("method.generator_update_interval=1", "method.block_gradients=on"))],
    ids=["dmd2_lora", "self_forcing"])
def test_distribution_matching_on_two_processes_logs_the_losses_of_one(tmp_path, world_teacher, experiment, knobs):
    """DMD2 with a LoRA student and critic on the teacher's base (base and adapters both sharded), and Self-Forcing's
    streaming rollout with block-at-a-time gradients (its exits one draw for the batch, its noise per sample), over 2
    gloo processes, log what one process logs."""
    experiment = str(ROOT / "experiments" / experiment)
    paths = (f"models.student.path={world_teacher}", f"models.teacher.path={world_teacher}", *knobs)
    launch2(tmp_path / "two", *paths, experiment=experiment)
    launch1(tmp_path / "one", *paths, experiment=experiment)
    two, one = (tracking.read_scalars(tmp_path / name / "tb") for name in ("two", "one"))
    for name in ("critic_loss", "grad_norm/critic", "generator_loss", "grad_norm/student"):
        assert [s for s, _ in two[name]] == [s for s, _ in one[name]] and two[name], name
        for (_, got), (_, want) in zip(two[name], one[name]):  # reduction order, compounded over 3 updates
            assert math.isclose(got, want, rel_tol=5e-5, abs_tol=1e-8), (name, two[name], one[name])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-process, 1-process) run folders: eager (saving checkpoints 2 and 3), and remat with compiled blocks."""
    base = tmp_path_factory.mktemp("launch")
    variants = {"eager": ("run.checkpoint.every=2", "run.checkpoint.final=true"),
                "remat_compiled": ("models.student.remat=true", "models.student.compile=blocks", "models.student.compile_backend=aot_eager")}
    folders = {}
    for name, overrides in variants.items():
        launch2(base / f"{name}2", *overrides)
        launch1(base / f"{name}1", *overrides)
        folders[name] = (base / f"{name}2", base / f"{name}1")
    return folders


@pytest.mark.slow  # two launches of 2 processes: about 20 s on 2 cores
@pytest.mark.parametrize("variant", ["eager", "remat_compiled"])
def test_two_processes_log_the_losses_of_one_and_hold_half_the_state(runs, variant):
    two, one = (tracking.read_scalars(folder / "tb") for folder in runs[variant])
    for name in COMPARED:
        assert [s for s, _ in two[name]] == [0, 1, 2], name
        for (_, got), (_, want) in zip(two[name], one[name]):
            assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-9), (name, two[name], one[name])
    assert (runs[variant][0] / "config.json").is_file()
    ratio = two["state_bytes_per_rank"][0][1] / one["state_bytes_per_rank"][0][1]
    assert 0.5 <= ratio < 0.51, ratio  # even shards (+ padding, step and key): about half
    if variant == "remat_compiled":
        assert two["compile/graphs"] == one["compile/graphs"] == [(2, 1.0)]
        assert two["compile/recompiles"] == [(2, 0.0)]


def _state_of(folder: pathlib.Path, step: int):
    config = run_folder.load_run(folder)
    with resume.open_checkpoints(folder / run_folder.CHECKPOINTS) as checkpoints:
        return checkpoints.is_sharded(step), checkpoint.leaves_by_name(
            checkpoints.restore(step, start_state(config)))


def _relative_distance(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over all float tensors together."""
    names = [name for name, x in want.items() if x.is_floating_point()]
    diff = sum(float(((got[n] - want[n]) ** 2).sum()) for n in names)
    return math.sqrt(diff / sum(float((want[n] ** 2).sum()) for n in names))


@pytest.mark.slow  # the 2-process run is the fixture's
def test_a_two_process_checkpoint_resumes_on_one_process_and_continues_to_match(runs, tmp_path):
    """The 2-process run saved sharded checkpoints (per-rank shard files); one process resumes from step 2, and its last
    step and final state match both uninterrupted runs (fp32: reduction order only)."""
    two, one = runs["eager"]
    resumed = tmp_path / "resumed"
    launch1(resumed, "--resume", str(two / "checkpoints" / "2"), "run.checkpoint.final=true")
    logged = tracking.read_scalars(resumed / "tb")
    want = tracking.read_scalars(one / "tb")
    for name in COMPARED:
        assert [s for s, _ in logged[name]] == [2], name
        assert math.isclose(logged[name][0][1], want[name][2][1], rel_tol=REL, abs_tol=1e-9), name
    sharded, saved_two = _state_of(two, 3)
    plain, saved_one = _state_of(one, 3)
    assert sharded and not plain
    _, final = _state_of(resumed, 3)
    assert torch.equal(final["step"], saved_one["step"]) and torch.equal(final["key"], saved_one["key"])
    assert _relative_distance(saved_two, saved_one) < 1e-6  # measured 1.7e-7
    assert _relative_distance(final, saved_one) < 1e-6
    assert _relative_distance(final, saved_two) < 1e-6


@pytest.mark.slow  # the 2-process run is the fixture's
def test_replaying_a_two_process_step_in_one_process_passes_within_the_stated_tolerance(runs, capsys):
    two, _ = runs["eager"]
    assert run.main(["replay", str(two), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "within 1e-05 relative: the run used 2 processes, this replay 1" in out and "DIFFERENT" not in out


def _flip_a_byte(shard: pathlib.Path, name: str) -> None:
    """Flip one bit inside tensor ``name``'s bytes of the safetensors file ``shard``."""
    import json as _json
    import struct

    raw = bytearray(shard.read_bytes())
    header = int(struct.unpack("<Q", raw[:8])[0])
    begin, _ = _json.loads(raw[8:8 + header])[name]["data_offsets"]
    raw[8 + header + begin + 3] ^= 0x10
    shard.write_bytes(bytes(raw))


@pytest.mark.slow  # one more 2-process launch
def test_a_flipped_byte_in_a_shard_is_refused_by_name_on_one_and_two_processes(runs, tmp_path, capsys):
    import shutil

    two, _ = runs["eager"]
    damaged = tmp_path / "damaged"
    shutil.copytree(two, damaged)
    (damaged / ".fvx-lock").unlink(missing_ok=True)
    shard = damaged / "checkpoints" / "3" / "shards" / "rank-00001-of-00002.safetensors"
    name = "roles/student/params/proj_out.weight"
    _flip_a_byte(shard, name)
    message = f"shard file '{shard}': tensor '{name}' fails its checksum"
    assert run.main(["export", str(damaged), "--out", str(tmp_path / "exported")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "exported").exists()
    assert run.main([EXPERIMENT, "--out", str(damaged), "--resume", "3", *QUICK[2:]]) == 2
    assert message in capsys.readouterr().err
    assert message in launch2(damaged, "--resume", "3", expect=2)[0]


# ----------------------------------------------------------------------------------------------------------- dry run


def test_dry_run_prints_per_role_bytes_per_rank_from_shapes(capsys):
    assert run.main([EXPERIMENT, "--dry-run", "--world", "4", "--video", "33x256x256", "models.student.preset=wan2.1-t2v-1.3b",
                     "models.student.remat=true", "models.student.compute_dtype=bf16", "data.batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "wan:wan2.1-t2v-1.3b: 4 ranks" in out and "9x32x32 = 2304 tokens" in out and "2 sample(s) per rank" in out
    shapes = wan.WanConfig(preset="wan2.1-t2v-1.3b").build().memory_spec().shapes
    numel = sum(math.prod(s) for s in shapes.values())
    row = next(line for line in out.splitlines() if line.startswith("student")).split()[1:]
    params, grads, adamw, ema, total = (float(v) for v in row)
    per_rank = numel / 4 / memory.GIB  # every 1.3B param has a dimension 4 divides: no padding
    assert (params, grads, adamw, ema) == (round(4 * per_rank, 2), round(4 * per_rank, 2), round(8 * per_rank, 2), 0)


def test_dry_run_estimate_counts_micro_batches_and_rejects_bad_input():
    spec = wan.WanConfig(preset="tiny").build().memory_spec()
    role = memory.Role("student", spec, trainable=True)
    whole, _ = dry_run.estimate(dry_run.Plan((role,)), world=2, replicate=1, video=(17, 64, 64), global_batch=8)
    halves, _ = dry_run.estimate(dry_run.Plan((role,), micro_batches=2), world=2, replicate=1,
                                 video=(17, 64, 64), global_batch=8)
    assert whole.roles == halves.roles and whole.activations == 2 * halves.activations
    # SP 2 on 4 ranks: 2 data-parallel groups of 4 samples each, half the tokens of each on a rank
    sp, title = dry_run.estimate(dry_run.Plan((role,)), world=4, replicate=1, video=(17, 64, 64), global_batch=8,
                                 sp=2)
    assert "sequence parallel over 2" in title and "4 sample(s) per rank" in title
    assert sp.activations == memory.estimate((role,), shard_size=4, tokens=5 * 8 * 8 // 2, batch_per_rank=4,
                                             capacity=memory.H200_BYTES).activations
    # a section's history: its tokens (here one per latent position of a frame) beside the grid's, said in the title
    history, title = dry_run.estimate(dry_run.Plan((role,)), world=2, replicate=1, video=(17, 64, 64), global_batch=8,
                                      history=lambda grid: grid.height * grid.width)
    assert "= 320 tokens + 256 of the section's history" in title
    assert history.activations == memory.estimate((role,), shard_size=2, tokens=5 * 8 * 8 + 16 * 16, batch_per_rank=4,
                                                  capacity=memory.H200_BYTES).activations
    with pytest.raises(ValueError, match="not divisible by the 3 data-parallel groups"):
        dry_run.estimate(dry_run.Plan((role,)), world=3, replicate=1, video=(17, 64, 64), global_batch=8)
    with pytest.raises(ValueError, match="--sp 3 must be a positive divisor of --world 4"):
        dry_run.estimate(dry_run.Plan((role,)), world=4, replicate=1, video=(17, 64, 64), global_batch=8, sp=3)
    with pytest.raises(ValueError, match="FRAMESxHEIGHTxWIDTH"):
        dry_run.parse_video("17x64")


def test_dry_run_bad_video_is_one_clear_error(capsys):
    temporal = str(ROOT / "experiments" / "finetune_skyreels_v2.py")  # a VAE with 4x temporal compression
    assert run.main([temporal, "--dry-run", "--video", "16x64x64"]) == 2
    assert "frames must be 1 + a multiple of 4" in capsys.readouterr().err
