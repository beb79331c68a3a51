"""Resume is the uninterrupted run, bit for bit: after a clean stop, a SIGKILL during a step, and a SIGKILL during an
async save; logs hold one value per step; unusable checkpoints are one clear error that writes nothing."""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from fvx import run
from fvx.storage import checkpoint
from fvx.training import run_folder, tracking

from run_state import final_state  # noqa: E402

from run_state import start_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "tests" / "helpers" / "faulty_experiment.py")  # 8 steps, grad_accum 2, checkpoints every 2
COMPARED = ("loss", "grad_norm", "lr")


def train(out, *args) -> int:
    return run.main([EXPERIMENT, "--out", str(out), *args])


def assert_same_run(run_dir: pathlib.Path, reference: pathlib.Path) -> None:
    """Bit-identical logged metrics (one value per step 0..7) and final params and optimizer state."""
    logged, expected = tracking.read_scalars(run_dir / "tb"), tracking.read_scalars(reference / "tb")
    for name in COMPARED:
        assert [step for step, _ in logged[name]] == list(range(8)), name
        assert logged[name] == expected[name], name
    state, expected_state = final_state(run_dir), final_state(reference)
    assert state.keys() == expected_state.keys() and "step" in state
    assert any(".opt_state.0.mu." in name for name in state)
    for name, tensor in state.items():
        assert torch.equal(tensor, expected_state[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    """The uninterrupted run of 8 steps."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train(out) == 0
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [2, 4, 6, 8]
    return out


def test_resume_auto_starts_an_empty_folder_and_continues_one_with_checkpoints(tmp_path, reference, capsys):
    """One command for a requeued job: the first launch starts, the second (after a kill, say) resumes, bitwise."""
    out = tmp_path / "run"
    assert train(out, "--steps", "4", "--resume", "auto") == 0
    assert "resuming from" not in capsys.readouterr().out
    assert train(out, "--steps", "8", "--resume", "auto") == 0
    assert f"resuming from {out / 'checkpoints' / '4'} (step 4)" in capsys.readouterr().out
    assert_same_run(out, reference)


def test_n_steps_resumed_to_2n_is_the_2n_step_run(tmp_path, reference, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "4") == 0
    assert train(out, "--steps", "8", "--resume") == 0
    captured = capsys.readouterr()
    assert f"resuming from {out / 'checkpoints' / '4'} (step 4)" in captured.out
    assert "note: this launch changes run.steps: 4 -> 8" in captured.err
    assert_same_run(out, reference)


def test_resume_continues_with_the_runs_own_config_and_replay_uses_the_config_of_each_step(tmp_path, capsys):
    """Overrides given at the start stay in force on a resume that does not retype them; one retyped at the resume
    applies from there on; run.json keeps every launch, and replay of a step uses the config that ran it."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    first = ["method.optim.lr=5e-3", "run.checkpoint.every=3", "data.batch_size=2"]
    assert run.main([EXPERIMENT, "--out", str(whole), "--steps", "6", *first]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "3", *first]) == 0
    capsys.readouterr()
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "6", "--resume"]) == 0
    captured = capsys.readouterr()
    assert "with the config saved there" in captured.out and "this launch changes run.steps: 3 -> 6" in captured.err
    assert "lr" not in captured.err and "batch_size" not in captured.err
    with checkpoint.Checkpoints(resumed / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [3, 6]  # run.checkpoint.every=3 kept
    logged, expected = tracking.read_scalars(resumed / "tb"), tracking.read_scalars(whole / "tb")
    assert logged["loss"] == expected["loss"] and logged["lr"] == expected["lr"]
    history = run_folder.launches(resumed)
    assert [(h["start_step"], h["overrides"]) for h in history] == [
        (0, [*first, f"run.output_dir={resumed}", "run.steps=3"]), (3, [f"run.output_dir={resumed}", "run.steps=6"])]

    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "8", "--resume", "method.optim.lr=1e-3"]) == 0
    assert "this launch changes method.optim.lr: 0.005 -> 0.001" in capsys.readouterr().err
    assert run_folder.load_run(resumed, step=4).method.optim.lr == 5e-3
    assert run_folder.load_run(resumed).method.optim.lr == 1e-3
    for step in (2, 5, 7):  # before, between and after the resumes
        assert run.main(["replay", str(resumed), "--step", str(step)]) == 0, step
    assert "replay matches" in capsys.readouterr().out


def start_killable(out: pathlib.Path, signal_file: pathlib.Path, **env) -> subprocess.Popen:
    env = {**os.environ, **env, "FVX_TEST_SIGNAL": str(signal_file), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fvx.run", EXPERIMENT, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_when(process: subprocess.Popen, ready, what: str) -> None:
    """SIGKILL ``process`` once ``ready()`` holds (it hangs there by then)."""
    deadline = time.monotonic() + 300  # a safety net against a hang of the test itself, not a speed check
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the run never got {what}:\n{process.communicate()[0]}")
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_killed_runs_resume_from_their_newest_complete_checkpoint(tmp_path, reference, capsys):
    """One run is SIGKILLed during step 5 (checkpoint 4 complete), one while the async save of checkpoint 4 writes
    (checkpoint 2 complete; 4 a temporary folder). Both start at once, to share their start-up time."""
    in_step, in_save = tmp_path / "in_step", tmp_path / "in_save"
    stepping = start_killable(in_step, tmp_path / "stepping", FVX_TEST_HANG_AT_STEP="5")
    saving = start_killable(in_save, tmp_path / "saving", FVX_TEST_HANG_IN_SAVE="4")
    kill_when(stepping, lambda: (tmp_path / "stepping").exists()
              and 4 in checkpoint.Checkpoints(in_step / "checkpoints").steps(), "to step 5 with checkpoint 4 complete")
    kill_when(saving, (tmp_path / "saving").exists, "into the save of checkpoint 4")

    assert train(in_step, "--resume") == 0
    assert f"resuming from {in_step / 'checkpoints' / '4'} (step 4)" in capsys.readouterr().out
    assert_same_run(in_step, reference)

    unfinished = in_save / "checkpoints" / f"4{checkpoint.TMP_SUFFIX}"
    assert any(path.suffix == ".safetensors" for path in unfinished.rglob("*"))  # state written, never completed
    assert checkpoint.Checkpoints(in_save / "checkpoints").steps() == [2]
    assert train(in_save, "--resume") == 0
    assert f"resuming from {in_save / 'checkpoints' / '2'} (step 2)" in capsys.readouterr().out
    assert not unfinished.exists()
    assert checkpoint.Checkpoints(in_save / "checkpoints").steps() == [2, 4, 6, 8]
    assert_same_run(in_save, reference)


def test_truncate_events_drops_the_steps_a_resumed_run_takes_again(tmp_path):
    """Later steps go, and at the resumed step the loop's own step record; what else was logged there stays."""
    with tracking.open_tracker(tmp_path) as tracker:
        tracker.hparams({"lr": 0.1})
        for step in range(6):
            tracker.scalars(step, {"loss": float(step), tracking.STEP_RECORD: 0.1})
        tracker.scalars(3, {"validation/mse": 0.5})
    assert tracking.truncate_events(tmp_path, 3) == 3
    tracking.wait_for_a_new_second(tmp_path)  # as the loop does: event files sort by their second
    with tracking.open_tracker(tmp_path) as tracker:
        for step in range(3, 5):
            tracker.scalars(step, {"loss": 10.0 + step})
    assert tracking.read_scalars(tmp_path)["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert tracking.read_scalars(tmp_path)["validation/mse"] == [(3, 0.5)]
    assert tracking.read_hparams(tmp_path) == {"lr": 0.1}


def test_a_damaged_event_record_is_reported_and_the_history_around_it_kept(tmp_path):
    with tracking.open_tracker(tmp_path) as tracker:
        for step in range(6):
            tracker.scalars(step, {"loss": float(step), tracking.STEP_RECORD: 0.1})
    (path,) = tmp_path.glob("events.out.tfevents.*")
    records, damaged = tracking.read_records(path)
    assert damaged == []
    raw = bytearray(path.read_bytes())
    offset = sum(12 + len(r) + 4 for r in records[:3])  # the record of step 2 (after the file-version record)
    raw[offset + 14] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert [s for s, _ in tracking.read_scalars(tmp_path)["loss"]] == [0, 1]  # TensorBoard stops at the damage
    lines = []
    assert tracking.truncate_events(tmp_path, 5, report=lines.append) == 1  # step 5; the damaged record aside
    assert lines == [f"note: {path} has a damaged TensorBoard record at byte {offset}; it is dropped and the records "
                     "around it are kept"]
    assert [s for s, _ in tracking.read_scalars(tmp_path)["loss"]] == [0, 1, 3, 4]


def copy_run(reference: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    shutil.copytree(reference, out)
    return out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax, after a failed read
def test_bad_resume_is_one_clear_error_that_writes_nothing(tmp_path, reference, capsys):
    def fails(out, *args, match):
        before = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None
        assert train(out, *args) == 2
        err = capsys.readouterr().err
        assert err.startswith("fvx.run: error:") and match in err and "Traceback" not in err, err
        assert (sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None) == before

    fails(tmp_path / "fresh", "--resume", match=f"no checkpoint to resume from in '{tmp_path / 'fresh'}")
    run_dir = copy_run(reference, tmp_path / "copy")
    fails(run_dir, "--resume", "3", match="no checkpoint of step 3 in")
    fails(run_dir, "--resume", "4", match="holds later checkpoints (6, 8)")
    fails(run_dir, match="already holds checkpoints (2, 4, 6, 8): continue that run with --resume")
    fails(tmp_path / "elsewhere", "--resume", str(tmp_path / "nowhere"), match="no such checkpoint")

    # A checkpoint whose model has another shape: every mismatched tensor is listed with both shapes.
    with checkpoint.Checkpoints(run_dir / "checkpoints") as checkpoints:
        target = start_state(run_folder.load_run(run_dir))
        state = checkpoints.restore(8, target)
    params = state.roles["student"].params
    params["proj_out.weight"] = torch.zeros(32, 96)
    wider = tmp_path / "wider" / "checkpoints"
    with checkpoint.Checkpoints(wider, checkpoint.CheckpointConfig(async_save=False)) as checkpoints:
        checkpoints.save(state, config={}, meta={})
    fails(tmp_path / "other", "--resume", str(wider / "8"),
          match="shape or dtype mismatches (1): roles.student.params.proj_out.weight: checkpoint [32, 96] float32, "
                "run [64, 96] float32")

    # A corrupt checkpoint: named, not restored.
    data = max((run_dir / "checkpoints" / "8" / "shards").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])
    fails(run_dir, "--resume", match=f"checkpoint '{run_dir / 'checkpoints' / '8'}' is corrupt or truncated")


def test_a_resume_at_a_validation_step_keeps_its_validation_and_a_smaller_steps_is_refused(tmp_path, capsys):
    """Checkpoint 4 is also validation step 4: resuming from it keeps that validation (scalars and videos, logged
    from the state it resumes) and drops only the step records it takes again; --steps below 4 is one line, and
    nothing in the run folder changes."""
    out, toy = tmp_path / "run", str(ROOT / "experiments" / "finetune_wan.py")
    quick = ["run.progress=false", "data.batch_size=2", "run.checkpoint.every=2", "validation.every=2",
             "validation.num_prompts=2", "validation.num_steps=2"]
    assert run.main([toy, "--out", str(out), "--steps", "4", *quick]) == 0
    before = tracking.read_scalars(out / "tb")
    videos = {tag: [step for step, _ in events] for tag, events in tracking.read_images(out / "tb").items()}
    assert [step for step, _ in before["validation/model/nearest_mse"]] == [0, 2, 4]
    assert run.main([toy, "--out", str(out), "--resume", "--steps", "6", "validation.every=0"]) == 0
    after = tracking.read_scalars(out / "tb")
    assert after["validation/model/nearest_mse"] == before["validation/model/nearest_mse"]
    assert {tag: [step for step, _ in events] for tag, events in tracking.read_images(out / "tb").items()} == videos
    assert [step for step, _ in after["loss"]] == list(range(6)) and after["loss"][:4] == before["loss"]
    files = {p: p.read_bytes() for p in [out / "config.json", out / "run.json", *(out / "tb").iterdir()]}
    capsys.readouterr()
    assert run.main([toy, "--out", str(out), "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "run.steps = 3 is below step 6 of the checkpoint it resumes from" in err
    assert len(err.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in files} == files
