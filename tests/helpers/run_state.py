"""What the resume tests compare: the tensors of a run folder's newest checkpoint."""
from __future__ import annotations

import pathlib

from fvx.storage import checkpoint
from fvx.training import run_folder


def final_state(run_dir: pathlib.Path) -> dict:
    """Every tensor of the run's newest checkpoint, by dotted name."""
    with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
        return checkpoint.leaves_by_name(checkpoints.read(checkpoints.latest(), ()))
