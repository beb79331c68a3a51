"""fvx.training.callbacks: every hook runs in order with what it should see, a callback logs through the tracker, and a
callback that raises stops the run by name with its checkpoints intact."""
import json
import pathlib

import pytest

from fvx import run
from fvx.storage import checkpoint
from fvx.training import callbacks, run_folder, tracking

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "helpers" / "callback_experiment.py")


def events(path):
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]


def test_hooks_run_in_order_and_log_through_the_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("FVX_TEST_EVENTS", str(tmp_path / "events"))
    assert run.main([EXPERIMENT, "--out", str(tmp_path / "run")]) == 0
    seen = events(tmp_path / "events")
    metrics = ["grad_norm", "loss", "lr"]
    step = [("on_before_optimizer_step", "student", True)]
    def validation(at):
        return [("on_validation_begin", at), ("on_validation_end", at)]

    assert seen == ([("on_train_start", 0)] + validation(0) + step + [("on_step_end", 1, metrics)] + step
                    + [("on_step_end", 2, metrics)] + validation(2) + step + [("on_step_end", 3, metrics)] + step
                    + [("on_step_end", 4, metrics)] + validation(4) + [("on_train_end", 4)])
    scalars = tracking.read_scalars(tmp_path / "run" / "tb")
    assert [s for s, _ in scalars["probe"]] == [0, 1, 2, 3]
    assert all(p == pytest.approx(2 * loss) for (_, p), (_, loss) in zip(scalars["probe"], scalars["loss"]))


def test_a_raising_callback_stops_the_run_by_name_and_keeps_its_checkpoints(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("FVX_TEST_EVENTS", str(tmp_path / "events"))
    monkeypatch.setenv("FVX_TEST_RAISE_AT", "3")
    assert run.main([EXPERIMENT, "--out", str(out)]) == 1
    message = capsys.readouterr().err
    assert "callback 'recorder' raised in on_step_end: RuntimeError: the probe saw enough" in message
    assert "--resume" in message
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as saved:
        assert saved.steps() == [2]
    monkeypatch.delenv("FVX_TEST_RAISE_AT")
    assert run.main([EXPERIMENT, "--out", str(out), "--resume"]) == 0
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as saved:
        assert saved.steps() == [2, 4]


def test_bad_callbacks_are_named():
    with pytest.raises(ValueError, match=r"callbacks\(\)\[1\] is a str, not an fvx.training.callbacks.Callback"):
        callbacks.check([callbacks.Callback("a"), "b"])
    with pytest.raises(ValueError, match="repeated: a"):
        callbacks.check([callbacks.Callback("a"), callbacks.Callback("a")])
    assert callbacks.before_update([callbacks.Callback("a")]) is None
