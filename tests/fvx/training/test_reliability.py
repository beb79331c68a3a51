"""Runs survive what happens to real runs: SIGTERM/SIGINT save and stop, one writer per run folder, a damaged newest
checkpoint, a full disk, runaway skips; and a sweep of SIGKILLs at random points resumes bitwise."""
import concurrent.futures
import errno
import json
import os
import pathlib
import random as pyrandom
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from fvx import config as fconfig, run
from fvx.storage import checkpoint, shard_files
from fvx.training import run_folder, run_lock, tracking

from run_state import final_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "tests" / "helpers" / "faulty_experiment.py")  # 8 steps, checkpoints every 2


def assert_same_run(run_dir: pathlib.Path, reference: pathlib.Path) -> None:
    logged, expected = tracking.read_scalars(run_dir / "tb"), tracking.read_scalars(reference / "tb")
    compared = [n for n in expected if "loss" in n or n.startswith(("grad_norm", "lr"))]
    assert compared
    for name in compared:
        assert logged[name] == expected[name], name
    state, want = final_state(run_dir), final_state(reference)
    assert state.keys() == want.keys()
    assert all(torch.equal(state[n], want[n]) for n in state)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    assert run.main([EXPERIMENT, "--out", str(out)]) == 0
    return out


def start(out: pathlib.Path, signal_file: pathlib.Path, *args: str, **env: str) -> subprocess.Popen:
    env = {**os.environ, **env, "FVX_TEST_SIGNAL": str(signal_file), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fvx.run", EXPERIMENT, "--out", str(out), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: pathlib.Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300  # a safety net against a hang, not a speed check
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.05)


def stop_while_paused(out: pathlib.Path, flag: pathlib.Path, signum: int, step: int, *args: str, **env: str) -> None:
    """Start a run that pauses where ``env`` says, send it ``signum`` there: it stops with the one line naming ``step``
    (a checkpoint of it saved), no traceback, and its lock released."""
    process = start(out, flag, *args, **env)
    wait_for(flag, process)
    process.send_signal(signum)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 128 + signum, output
    assert f"interrupted at step {step} ({signal.Signals(signum).name}; a checkpoint of it is saved); resume with: " \
           f"python -m fvx.run {EXPERIMENT} --out {out} --resume" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert not (out / run_lock.LOCK_FILE).exists()


# SIGTERM and SIGINT share one handler (tests/fvx/training/test_interrupts.py: each sets it): a process run takes one
# signal here and the other in the start-of-run validation below.


@pytest.mark.slow
def test_a_signal_saves_the_step_in_flight_and_resume_is_the_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "run"
    stop_while_paused(out, tmp_path / "paused", signal.SIGTERM, 5, FVX_TEST_PAUSE_AT_STEP="4")
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [2, 4, 5]  # step 4 (0-based) finished and was saved: checkpoint 5
    assert run.main([EXPERIMENT, "--out", str(out), "--resume"]) == 0
    assert_same_run(out, reference)


@pytest.mark.slow
def test_a_signal_during_the_start_of_run_validation_saves_step_0_and_resume_goes_on(tmp_path):
    out = tmp_path / "run"
    validated = ("validation.every=100", "validation.num_prompts=1", "validation.num_steps=2", "run.steps=2")
    stop_while_paused(out, tmp_path / "paused", signal.SIGINT, 0, *validated, FVX_TEST_PAUSE_IN_VALIDATION="1")
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [0]
    assert run.main([EXPERIMENT, "--out", str(out), "--resume", *validated]) == 0
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [0, 2]
    assert [step for step, _ in tracking.read_scalars(out / "tb")["validation/model/latent_std"]][0] == 0


def test_one_writer_per_run_folder_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    out, flag = tmp_path / "run", tmp_path / "paused"
    first = start(out, flag, FVX_TEST_PAUSE_AT_STEP="1")
    wait_for(flag, first)
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert f"is in use by pid {first.pid} on {socket.gethostname()}" in err and len(err.strip().splitlines()) == 1
    assert first.wait(timeout=300) == 0  # the first finishes its history untouched
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [2, 4, 6, 8]
    assert not (out / run_lock.LOCK_FILE).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / run_lock.LOCK_FILE).write_text(f'{{"pid": {dead.pid}, "host": "{socket.gethostname()}", '
                                          f'"started": "yesterday"}}')
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "9", "--resume"]) == 0  # stale: taken over


def test_a_damaged_newest_checkpoint_is_named_and_last_good_resumes_from_the_intact_one(tmp_path, reference, capsys):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "6"]) == 0
    data = max((out / "checkpoints" / "6" / "shards").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))
    capsys.readouterr()
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "8", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "checkpoints/6" in err and "the newest intact checkpoint is 4: resume from it with --resume last-good" in err
    assert len(err.strip().splitlines()) == 1
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "8", "--resume", "last-good"]) == 0
    assert (out / "checkpoints" / "6.damaged").is_dir()  # moved aside, never deleted
    assert_same_run(out, reference)


def test_a_flipped_byte_in_a_checkpoints_config_or_run_json_is_refused_by_name_and_last_good_recovers(
        tmp_path, reference, capsys):
    """The config saved with a checkpoint decides how the run goes on: a flipped digit of its learning rate (still
    valid JSON) fails the CRC saved with the state, is named, and last-good moves that checkpoint aside; a flipped
    byte in run.json is named in one line, before anything is written."""
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "6"]) == 0
    record = out / "checkpoints" / "6" / "config" / "metadata"
    text = record.read_text()
    assert '"lr": 0.001' in text
    record.write_text(text.replace('"lr": 0.001', '"lr": 0.002'))
    capsys.readouterr()
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "8", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file '{record}' is corrupt: it fails the checksum saved with the state" in err
    assert "the newest intact checkpoint is 4" in err and len(err.strip().splitlines()) == 1
    history = (out / "run.json").read_bytes()
    for position in range(len(history)):  # one bit of every byte: refused by name, or the same launches
        flipped = bytearray(history)
        flipped[position] ^= 0x01
        (out / "run.json").write_bytes(bytes(flipped))
        try:
            assert run_folder.launches(out) == json.loads(history)["launches"], position
        except fconfig.ConfigError as error:
            assert str(out / "run.json") in str(error)
    (out / "run.json").write_bytes(history.replace(b'"start_step": 0', b'"start_step": 1'))
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "8", "--resume", "last-good"]) == 2
    err = capsys.readouterr().err
    assert f"'{out / 'run.json'}' is damaged (it fails the checksum it was written with)" in err
    assert len(err.strip().splitlines()) == 1 and (out / "checkpoints" / "6").is_dir()  # nothing moved or written
    (out / "run.json").write_bytes(history)
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "8", "--resume", "last-good"]) == 0
    assert (out / "checkpoints" / "6.damaged").is_dir()
    assert_same_run(out, reference)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_stops_the_run_cleanly_and_it_resumes_once_space_is_freed(tmp_path, reference, capsys,
                                                                              monkeypatch, async_save):
    out = tmp_path / "run"
    write = shard_files.write

    def full_at_six(folder, *args):
        if f"/6{checkpoint.TMP_SUFFIX}/" in str(folder) + "/":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(folder, *args)

    monkeypatch.setattr(shard_files, "write", full_at_six)
    flag = f"run.checkpoint.async_save={str(async_save).lower()}"
    assert run.main([EXPERIMENT, "--out", str(out), flag]) == 1
    err = capsys.readouterr().err
    assert f"saving checkpoint 6 to '{out / 'checkpoints' / '6'}' failed: No space left on device" in err
    assert "earlier checkpoints are intact" in err and "--resume" in err and len(err.strip().splitlines()) == 1
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [2, 4]  # no half checkpoint 6 listed
        checkpoints.read(4, ("roles", "student", "params"))  # loadable
    monkeypatch.setattr(shard_files, "write", write)  # space freed
    assert run.main([EXPERIMENT, "--out", str(out), flag, "--resume"]) == 0
    assert_same_run(out, reference)


def test_runaway_skips_halt_with_the_replay_command_and_the_count_is_printed(tmp_path, capsys):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "run.on_nonfinite=skip", "run.max_consecutive_skips=2",
                     "method.nan_from_step=3"]) == 1
    err = capsys.readouterr().err
    assert "step 5: non-finite" in err and "3 steps in a row were skipped, more than run.max_consecutive_skips=2" in err
    assert f"python -m fvx.run replay {out} --step 5" in err
    assert run.main([EXPERIMENT, "--out", str(tmp_path / "once"), "run.on_nonfinite=skip",
                     "method.nan_at_step=3"]) == 0
    assert "; 1 non-finite step(s) skipped in all" in capsys.readouterr().out


def kill_and_resume(args: list[str], out: pathlib.Path, rng: pyrandom.Random) -> None:
    """Three rounds that start (or resume) the run in a process of one thread and SIGKILL it after a random delay,
    then a run to its end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(3):
        resume = ["--resume"] if (out / "checkpoints").is_dir() else []
        process = subprocess.Popen([sys.executable, "-m", "fvx.run", *args, "--out", str(out), *resume], cwd=ROOT,
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 6.0))
        process.kill()
        process.wait()
    resume = ["--resume"] if (out / "checkpoints").is_dir() and checkpoint.Checkpoints(out / "checkpoints").steps() \
        else []
    assert subprocess.run([sys.executable, "-m", "fvx.run", *args, "--out", str(out), *resume], cwd=ROOT, env=env,
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_sigkill_at_random_points_always_resumes_bitwise(tmp_path, world_teacher):
    """A seeded sweep for fine-tuning and for DMD2 (the two side by side, a core each): each round starts (or resumes)
    the run and SIGKILLs it after a random delay; once it has finished, its logs and final state equal the
    uninterrupted run's."""
    runs = {"finetune": [EXPERIMENT, "run.checkpoint.every=1", "run.steps=10"],
            "dmd2": [str(ROOT / "experiments" / "dmd2.py"), "run.checkpoint.every=1", "run.steps=10",
                     "data.batch_size=2", "validation.every=0", "run.progress=false",
                     f"models.student.path={world_teacher}", f"models.teacher.path={world_teacher}",
                     "method.generator_update_interval=2"]}
    for name, args in runs.items():
        assert run.main([*args, "--out", str(tmp_path / name / "reference")]) == 0
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        sweeps = [pool.submit(kill_and_resume, args, tmp_path / name / "killed", pyrandom.Random(seed))
                  for seed, (name, args) in enumerate(runs.items())]
    for sweep in sweeps:
        sweep.result()  # (an assertion inside a sweep)
    for name in runs:
        assert_same_run(tmp_path / name / "killed", tmp_path / name / "reference")


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_saved_step(tmp_path, reference):
    """torchrun forwards a signal to every worker, but not at the same instant: a stop agreed over the ranks makes
    all of them save the same step. Here only rank 1 is signalled."""
    out, flag = tmp_path / "run", tmp_path / "paused"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "FVX_TEST_PAUSE_AT_STEP": "4", "FVX_TEST_SIGNAL": str(flag) + str(rank)}
        procs.append(subprocess.Popen([sys.executable, "-m", "fvx.run", EXPERIMENT, "--out", str(out)], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_for(pathlib.Path(str(flag) + "1"), procs[1])
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outputs
    assert "interrupted at step 5" in outputs[0]
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps() == [2, 4, 5]
    assert run.main([EXPERIMENT, "--out", str(out), "--resume"]) == 0  # 2 processes saved it, 1 resumes it
    logged, expected = tracking.read_scalars(out / "tb"), tracking.read_scalars(reference / "tb")
    for (_, got), (_, want) in zip(logged["loss"], expected["loss"]):
        assert abs(got - want) <= 1e-5 * abs(want)  # 2 processes differ from one in reduction order only


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_signalled_or_dead_torchrun_launcher_stops_its_workers_at_one_saved_step(tmp_path, reference, signum):
    """SIGTERM to torchrun reaches both workers (JAX's preemption notifier does not swallow it); a SIGKILLed
    launcher leaves orphans, which notice and stop the same way: both save one step and exit."""
    out, flag = tmp_path / "run", tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "FVX_TEST_PAUSE_AT_STEP": "4",
           "FVX_TEST_SIGNAL": str(flag)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(port), "-m", "fvx.run", EXPERIMENT, "--out", str(out)], env=env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    wait_for(flag, launcher)
    launcher.send_signal(signum)
    launcher.communicate(timeout=300)
    deadline = time.monotonic() + 120  # workers of a killed launcher stop on their own
    while _workers_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers_of(out)
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        assert checkpoints.steps()[-1] == 5  # the step in flight, saved by both
    assert run.main([EXPERIMENT, "--out", str(out), "--resume"]) == 0  # 2 processes saved it, 1 resumes it
    logged, expected = tracking.read_scalars(out / "tb"), tracking.read_scalars(reference / "tb")
    assert [s for s, _ in logged["loss"]] == list(range(8))
    for (_, got), (_, want) in zip(logged["loss"], expected["loss"]):
        assert abs(got - want) <= 1e-5 * abs(want)  # 2 processes differ from one in reduction order only


def _workers_of(out: pathlib.Path) -> list[int]:
    """Pids of fvx.run processes writing ``out``."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"fvx.run" in cmdline and str(out).encode() in cmdline:
                found.append(int(proc.name))
    return found
