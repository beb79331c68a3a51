"""fvx_methods.trajectory_cache: the teacher's Euler ODE against a hand computation (states exactly at the t_list
times, guidance applied), resuming after a failure or a kill to the same bytes, ranks, refused metadata, no pickle,
and bad input that writes nothing."""
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load

from fvx.core import flow, random, role
from fvx.data import datasets as data
from fvx.training import experiment
from fvx_methods import trajectory_cache as tc

from cli_args import merged  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENT = str(ROOT / "experiments" / "kd_t2v.py")
SHIFT = 3.0


def tiny(teacher, *extra):
    """Overrides for a cache of 8 toy-world samples from a 3-step teacher, two recorded times."""
    return merged(f"models.teacher.path={teacher}", f"models.student.path={teacher}", "data.world.num_samples=8",
                  "method.teacher_steps=3", "method.t_list=[999,624,0]", "run.progress=false", *extra)


def build(folder, teacher, *extra, batch=2, **kwargs):
    config = experiment.load_config(EXPERIMENT, tiny(teacher, f"method.cache={folder}", *extra))
    return tc.build(config, batch=batch, **kwargs)


def files(folder):
    """Every file of a cache folder, relative path -> bytes."""
    folder = pathlib.Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, world_teacher):
    """An uninterrupted build: the bytes every other build must reproduce."""
    folder = tmp_path_factory.mktemp("reference") / "cache"
    done = build(folder, world_teacher)
    assert done == tc.Build(written=8, found=0, total=8, complete=True)
    return files(folder)


# ------------------------------------------------------------------------------------------------------ the ODE


def hand_levels(steps, shift, times):
    """The teacher's grid by hand: shift(1 - k / K) for k < K, the levels t / 1000, and 0, descending."""
    grid = [shift * (1 - k / steps) / (1 + (shift - 1) * (1 - k / steps)) for k in range(steps)]
    return sorted({*grid, *(t / 1000 for t in times), 0.0}, reverse=True)


def teacher_of(config):
    models = experiment.build_models(config)
    model = models["teacher"]
    params = role.frozen_params(tc.cache_keys(experiment.run_keys(config.run.seed)[0])[0], {"t": (model, True)})["t"]
    return model, params


def test_the_states_sit_exactly_at_the_t_list_times_of_the_teachers_euler_ode(tmp_path, world_teacher, reference):
    config = experiment.load_config(EXPERIMENT, tiny(world_teacher, f"method.cache={tmp_path}"))
    levels, positions = tc.ode_levels(tc.trajectory_of(config))
    torch.testing.assert_close(levels, torch.tensor(hand_levels(3, SHIFT, [999, 624])), rtol=1e-6, atol=0)
    assert [levels[p].item() for p in positions] == (torch.tensor([999, 624]) / torch.tensor(1000.0)).tolist()
    model, params = teacher_of(config)
    dataset = data.open_dataset(config.data, experiment.run_keys(config.run.seed)[1])
    index = 5
    batch = model.batch({**dataset.read([index]), "sample_index": torch.tensor([index])})
    noise_key = tc.cache_keys(experiment.run_keys(config.run.seed)[0])[1]
    x = random.normal(random.fold_in(noise_key, index), (192, 4, 2, 2))[None]
    recorded = {}
    for level, next_level in zip(levels.tolist(), levels.tolist()[1:]):
        recorded[level] = x
        with torch.no_grad():
            v = model.apply(params, x, torch.tensor([1000 * level], dtype=torch.float32), batch["cond"])
        x = x + (next_level - level) * v
    cached = load(reference[f"samples/{index:08d}.safetensors"])
    torch.testing.assert_close(cached["states"][0], recorded[levels[positions[0]].item()][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cached["states"][1], recorded[levels[positions[1]].item()][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cached["x0"], x[0], rtol=1e-5, atol=1e-5)
    assert cached["times"].tolist() == [999, 624] and cached["times"].dtype == torch.int64
    assert sorted(k for k in cached if k.startswith("cond.")) == sorted(f"cond.{n}" for n in batch["cond"])
    for name, tensor in batch["cond"].items():
        assert torch.equal(cached[f"cond.{name}"], tensor[0])


def test_guidance_is_applied_with_the_unconditional_cond(tmp_path, world_teacher):
    """teacher_guidance_scale 3 (zero uncond), one Euler step 1 -> 0.999 -> 0: uncond + 3 (cond - uncond) at both."""
    extra = ["method.teacher_steps=1", "method.t_list=[999,0]", "method.teacher_guidance_scale=3.0",
             "method.cfg_uncond=zero", "data.world.num_samples=2"]
    folder = tmp_path / "guided"
    build(folder, world_teacher, *extra)
    config = experiment.load_config(EXPERIMENT, tiny(world_teacher, f"method.cache={folder}", *extra))
    model, params = teacher_of(config)
    batch = model.batch({**data.open_dataset(config.data, experiment.run_keys(0)[1]).read([1]),
                         "sample_index": torch.tensor([1])})
    zero = {name: torch.zeros_like(t) for name, t in batch["cond"].items()}

    def guided(x, level):
        t = torch.tensor([1000 * level], dtype=torch.float32)
        with torch.no_grad():
            cond, uncond = model.apply(params, x, t, batch["cond"]), model.apply(params, x, t, zero)
        return uncond + 3.0 * (cond - uncond)

    level = torch.tensor(999, dtype=torch.float32) / 1000
    x = random.normal(random.fold_in(tc.cache_keys(experiment.run_keys(0)[0])[1], 1), (192, 4, 2, 2))[None]
    x = x + (level - 1.0) * guided(x, 1.0)
    state = x
    x0 = x + (0.0 - level) * guided(x, level.item())
    cached, _ = tc.read_sample(tc.sample_path(folder, 1))
    torch.testing.assert_close(cached["states"][0], state[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cached["x0"], x0[0], rtol=1e-5, atol=1e-5)
    unguided = tmp_path / "unguided"
    build(unguided, world_teacher, *extra[:2], "data.world.num_samples=2")
    assert not torch.equal(tc.read_sample(tc.sample_path(unguided, 1))[0]["x0"], cached["x0"])


# --------------------------------------------------------------------------------------------------- resuming


def test_a_build_that_fails_midway_resumes_to_the_same_bytes(tmp_path, world_teacher, reference):
    folder, written = tmp_path / "cache", []

    def fail_after_three(index):
        written.append(index)
        if len(written) == 3:
            raise RuntimeError("injected failure")

    with pytest.raises(RuntimeError, match="injected"):
        build(folder, world_teacher, after_write=fail_after_three)
    assert not (folder / tc.COMPLETE).exists() and len(list((folder / tc.SAMPLES).iterdir())) == 3
    assert (folder / tc.METADATA).is_file()  # written first
    done = build(folder, world_teacher)
    assert (done.written, done.found, done.complete) == (5, 3, True)
    assert files(folder) == reference
    assert build(folder, world_teacher).written == 0  # complete: nothing more to do


@pytest.mark.slow  # three processes import torch and diffusers: 20-60 s on 2 cores
def test_a_killed_build_resumes_to_the_same_bytes(tmp_path, world_teacher):
    """SIGKILL while the command writes (one sample per group), then the command again: byte-identical to an
    uninterrupted build; the kill leaves no partial sample, only temporary files that the resume removes."""
    knobs = ("data.world.num_samples=16", "method.teacher_steps=8")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert build(whole, world_teacher, *knobs, batch=1).complete
    command = [sys.executable, "-m", "fvx_methods.trajectory_cache", EXPERIMENT, *tiny(world_teacher, *knobs), "--batch",
               "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([*command, f"method.cache={killed}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((killed / tc.SAMPLES).glob("*.safetensors"))) < 4:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    left = len(list((killed / tc.SAMPLES).glob("*.safetensors")))
    assert 4 <= left < 16 and not (killed / tc.COMPLETE).exists()
    result = subprocess.run([*command, f"method.cache={killed}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"({left} were there); complete, 16 samples" in result.stdout
    assert files(killed) == files(whole)


def test_ranks_build_their_own_groups_and_the_last_completes_it(tmp_path, world_teacher, reference):
    folder = tmp_path / "cache"
    first = build(folder, world_teacher, rank=1, world=2)
    assert (first.written, first.complete) == (4, False)
    assert sorted(p.name for p in (folder / tc.SAMPLES).iterdir()) == [f"{i:08d}.safetensors" for i in (2, 3, 6, 7)]
    assert build(folder, world_teacher, rank=0, world=2).complete
    assert files(folder) == reference


# ---------------------------------------------------------------------------------------------- refusals, format


@pytest.mark.parametrize("override, field", [
    ("method.teacher_steps=4", "teacher_steps: the cache has 3, this run 4"),
    ("method.t_list=[999,500,0]", "t_list: the cache has [999, 624, 0], this run [999, 500, 0]"),
    ("run.seed=1", "data.rows_sha256: the cache has"),  # the seed draws the toy world's clips too
    ("data.world.speed=1", "data.rows_sha256"),
    ("method.flow_shift=5.0", "shift: the cache has 3.0, this run 5.0"),
])
def test_a_restart_with_other_metadata_is_refused_naming_the_field(tmp_path, world_teacher, reference, capsys,
                                                                   override, field):
    folder = tmp_path / "cache"
    folder.mkdir()
    for name, payload in reference.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(payload)
    assert tc.main([EXPERIMENT, *tiny(world_teacher, f"method.cache={folder}", override), "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and field in err and "was built otherwise" in err, err
    assert files(folder) == reference


def test_the_batch_of_a_resume_must_be_the_builds(tmp_path, world_teacher, reference, capsys):
    folder = tmp_path / "cache"
    for name, payload in reference.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(payload)
    assert tc.main([EXPERIMENT, *tiny(world_teacher, f"method.cache={folder}"), "--batch", "4"]) == 2
    assert "batch: the cache has 2, this run 4" in capsys.readouterr().err
    assert tc.main([EXPERIMENT, *tiny(world_teacher, f"method.cache={folder}")]) == 0  # without --batch: the cache's
    assert "wrote 0 samples" in capsys.readouterr().out and files(folder) == reference


def test_no_pickle_in_the_cache(reference):
    """Every sample is a safetensors file (an 8-byte header length, a JSON header, raw tensor bytes), the rest
    JSON; nothing that pickle or torch.load would read."""
    for name, payload in reference.items():
        assert b"\x80\x02" not in payload[:2] and b"\x80\x04" not in payload[:2] and not payload.startswith(b"PK")
        if name.startswith("samples/"):
            (length,) = struct.unpack("<Q", payload[:8])
            header = json.loads(payload[8:8 + length])
            assert {"states", "times", "x0"} <= set(header) and all(
                entry["dtype"] in ("F32", "I64", "BOOL") for key, entry in header.items() if key != "__metadata__")
        else:
            json.loads(payload)
    assert set(json.loads(reference["metadata.json"])) >= {"teacher", "data", "t_list", "times", "teacher_steps",
                                                           "shift", "guidance", "format", "seed", "batch"}


@pytest.mark.parametrize("args, message", [
    ([str(ROOT / "experiments" / "finetune_wan.py")], "method Finetune builds no trajectory cache"),
    ([EXPERIMENT, "method.t_list=[999,500]"], "must be strictly descending timesteps in [0, 1000] ending in 0"),
    ([EXPERIMENT, "method.teacher_guidance_scale=2.0"], "needs method.negative_prompt_path"),
    ([EXPERIMENT, "data.kind=text_only"], "takes the sample shape from the data's latents"),
    ([EXPERIMENT, "models.teacher.path=/nonexistent/teacher"], "/nonexistent/teacher"),
    ([EXPERIMENT, "method.teacher_stepz=3"], "did you mean 'method.teacher_steps'"),
    ([EXPERIMENT, "--batch", "0"], "--batch must be a positive int"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, world_teacher, capsys, args, message):
    folder = tmp_path / "cache"
    overrides = [] if args[0] != EXPERIMENT else [
        a for a in tiny(world_teacher) if not any(a.startswith(b.split("=")[0] + "=") for b in args)]
    cache = [f"method.cache={folder}"] if args[0] == EXPERIMENT else [f"run.output_dir={folder}"]
    assert tc.main([*args, *overrides, *cache]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fvx_methods.trajectory_cache: error:") and message in err, err
    assert len(err.strip().splitlines()) == 1 and not folder.exists()


def test_a_folder_that_is_not_a_cache_is_refused(tmp_path, world_teacher, capsys):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "notes.txt").write_text("mine")
    assert tc.main([EXPERIMENT, *tiny(world_teacher, f"method.cache={tmp_path / 'cache'}")]) == 2
    assert "is a non-empty folder without metadata.json" in capsys.readouterr().err
    assert os.listdir(tmp_path / "cache") == ["notes.txt"]


def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        tc.main(["--help"])
    assert exit_.value.code == 0 and "Resumable" in capsys.readouterr().out


def test_cache_keys_and_levels_are_pure(world_teacher):
    key = random.key(3)
    assert all(torch.equal(a, b) for a, b in zip(tc.cache_keys(key), tc.cache_keys(key)))
    trajectory = tc.Trajectory((1000, 999, 500, 0), 4, 3.0, 1.0, "zero", None, "x", "teacher")
    levels, positions = tc.ode_levels(trajectory)
    assert levels[0] == 1.0 and levels[-1] == 0 and (levels[1:] < levels[:-1]).all()
    assert [round(levels[p].item(), 6) for p in positions] == [1.0, 0.999, 0.5]
    assert flow.NUM_TRAIN_TIMESTEPS == 1000
