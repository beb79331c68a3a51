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
