"""What the resume tests compare: the tensors of a run folder's newest checkpoint, and the state checkpoints restore
into."""
from __future__ import annotations

import pathlib
from typing import Any

from fvx.storage import checkpoint
from fvx.training import experiment, run_folder


def final_state(run_dir: pathlib.Path) -> dict:
    """Every tensor of the run's newest checkpoint, by dotted name."""
    with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
        return checkpoint.leaves_by_name(checkpoints.read(checkpoints.latest(), ()))


def start_state(config) -> Any:
    """The state a run of ``config`` starts from (the target its checkpoints restore into)."""
    built = experiment.setup(config)
    return experiment.initial_state(built, experiment.batch_fn(config, built)(0))


def assert_resumes_bitwise(experiment_path: str, tmp_path: pathlib.Path, args: list[str],
                           metrics: tuple[str, ...]) -> dict:
    """3 steps whole, and 2 resumed to 3, of ``experiment_path`` with ``args``: the same ``metrics`` logged and the same
    final checkpoint, bit for bit; that final state by name."""
    import torch

    from fvx import run
    from fvx.training import tracking

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run.main([experiment_path, "--out", str(whole), "--steps", "3", *args]) == 0
    assert run.main([experiment_path, "--out", str(resumed), "--steps", "2", *args]) == 0
    assert run.main([experiment_path, "--out", str(resumed), "--steps", "3", "--resume", *args]) == 0
    expected, logged = tracking.read_scalars(whole / "tb"), tracking.read_scalars(resumed / "tb")
    for name in metrics:
        assert logged[name] == expected[name], name
    state, expected_state = final_state(resumed), final_state(whole)
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(tensor, expected_state[name]) for name, tensor in state.items())
    return state


def assert_one_line_errors(experiment_path: str, tmp_path: pathlib.Path, capsys: Any, args: list[str],
                           cases: list[tuple[list[str], str]]) -> None:
    """Each ``(overrides, message)``: exit 2 with one line holding ``message``, and no run folder written."""
    from fvx import run

    for overrides, message in cases:
        out = tmp_path / "run"
        assert run.main([experiment_path, "--out", str(out), *args, *overrides]) == 2, message
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
