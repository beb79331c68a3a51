"""Deterministic replay of any step of a run: ``replay_step(run_dir, step) -> metrics``.

Replay restores the newest checkpoint at or before ``step`` (or builds the initial state, a pure function of the config
and seed, when none precedes it), takes the steps from there up to ``step`` on the same batches and keys, then takes
``step`` once more and returns its metrics. :func:`compare` sets them beside what the run logged, as float32 (the
precision TensorBoard stores); a NaN matches a NaN. Replay is bitwise in the mode (eager or compiled), on the device
type and with the number of processes the run used; replaying a step of an N-process run in one process changes the
order of the ranks' reductions (means, norms), so then the metrics are compared within :data:`ACROSS_WORLDS`
(relative), and the report says which comparison it made.
"""
from __future__ import annotations

import math
import os
import pathlib
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from fvx.core.state import NONFINITE
from fvx.storage import checkpoint
from fvx.training import run_folder, tracking
from fvx.training.experiment import batch_fn, frozen_params, initial_state, setup


ACROSS_WORLDS = 1e-5  # relative tolerance when the run had another number of processes (measured: 1e-7)


class Replay(NamedTuple):
    """A replayed step: its metrics, the checkpoint it started from (None: the initial state), and where the config's
    classes came from (``fvx.training.run_folder.load_run_sources``)."""

    step: int
    metrics: dict[str, float]
    from_checkpoint: int | None
    sources: tuple[str, ...] = ()
    run_world: int = 1  # the processes of the launch that ran the step (this replay runs in one)


class Row(NamedTuple):
    """One metric of a replayed step beside its logged value (None: not logged)."""

    name: str
    replayed: float
    logged: float | None
    tolerance: float | None = None  # relative; None: the same float32

    @property
    def same(self) -> bool:
        if self.logged is None or self.tolerance is None:
            return self.logged is None or same_float32(self.replayed, self.logged)
        if math.isnan(self.replayed) or math.isnan(self.logged):
            return math.isnan(self.replayed) and math.isnan(self.logged)
        return math.isclose(self.replayed, self.logged, rel_tol=self.tolerance, abs_tol=1e-12)


def replay_step(run_dir: str | os.PathLike, step: int) -> dict[str, float]:
    """The metrics of step ``step`` of the run in ``run_dir``, computed again (see the module docstring)."""
    return replay(run_dir, step).metrics


def replay(run_dir: str | os.PathLike, step: int, *, progress: bool = False, experiment: str | None = None) -> Replay:
    """Recompute step ``step`` of the run in ``run_dir`` (with a progress bar on stderr when ``progress``), with the
    classes of the experiment file ``experiment`` when the caller names one (the run folder alone is data); a
    ValueError names a step the run does not have."""
    run_dir = pathlib.Path(run_dir)
    loaded = run_folder.load_run_sources(run_dir, step, experiment)
    config, taken = loaded.config, steps_taken(run_dir)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < taken:
        took = f"took steps 0 to {taken - 1}" if taken else "took no step yet"
        raise ValueError(f"replay: step {step!r} is not a step of the run in {str(run_dir)!r}: it {took} (of "
                         f"run.steps = {config.run.steps})")
    built = setup(config)
    batch_at = batch_fn(config, built)
    state = initial_state(built, batch_at(0))
    frozen = frozen_params(built)
    with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
        base = max((s for s in checkpoints.steps() if s <= step), default=None)
        if base is not None:
            state = checkpoints.restore(base, state)
    bar = tqdm(total=step + 1, initial=base or 0, desc="replay", unit="step", disable=not progress)
    for s in range(base or 0, step):
        state, _ = built.program.step_(state, frozen, batch_at(s))
        bar.update(1)
    _, metrics = built.program.step_(state, frozen, batch_at(step))
    bar.update(1)
    bar.close()
    run_world = int(run_folder.launch_at(run_dir, step).get("world_size") or 1)
    return Replay(step, {name: float(value) for name, value in metrics.items()}, base, loaded.sources, run_world)


def steps_taken(run_dir: pathlib.Path) -> int:
    """How many steps the run in ``run_dir`` has taken: as many as its newest checkpoint or its last logged step
    says, whichever is further."""
    with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
        newest = checkpoints.latest() or 0
    logdir = run_dir / run_folder.TENSORBOARD
    logged = tracking.read_scalars(logdir).get(tracking.STEP_RECORD, []) if logdir.is_dir() else []
    return max(newest, max((s for s, _ in logged), default=-1) + 1)


def logged_metrics(run_dir: str | os.PathLike, step: int) -> dict[str, float]:
    """The scalars the run in ``run_dir`` logged at ``step`` (the last value where a tag repeats)."""
    logdir = pathlib.Path(run_dir) / run_folder.TENSORBOARD
    if not logdir.is_dir():
        return {}
    return {tag: value for tag, events in tracking.read_scalars(logdir).items() for s, value in events if s == step}


def compare(replayed: dict[str, float], logged: dict[str, float], tolerance: float | None = None) -> list[Row]:
    """Each replayed metric (but the ``nonfinite`` flag, which the loop does not log) beside its logged value,
    compared bitwise as float32 or, with ``tolerance``, within it (relative)."""
    return [Row(name, value, logged.get(name), tolerance) for name, value in sorted(replayed.items())
            if name != NONFINITE]


def tolerance_for(result: Replay) -> float | None:
    """None (bitwise) when the replay runs with the run's number of processes, else :data:`ACROSS_WORLDS`."""
    return None if result.run_world == 1 else ACROSS_WORLDS


def same_float32(a: float, b: float) -> bool:
    """Whether ``a`` and ``b`` are the same float32 value (any NaN matches any NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return np.float32(a).tobytes() == np.float32(b).tobytes()


def report(result: Replay, rows: list[Row], run_dir: str | os.PathLike) -> str:
    """The table ``python -m fvx.run replay`` prints."""
    start = "the initial state" if result.from_checkpoint is None else f"checkpoint {result.from_checkpoint}"
    forward = result.step - (result.from_checkpoint or 0)
    lines = [f"replay of step {result.step} of {run_dir}: from {start}, {forward} step(s) forward, then step "
             f"{result.step}", f"config: {pathlib.Path(run_dir) / 'config.json'}"
             + "".join(f"\n  {source}" for source in result.sources),
             f"  {'metric':<16}{'replayed':>18}{'logged':>18}"]
    for row in rows:
        logged = "not logged" if row.logged is None else f"{row.logged:.9g}"
        verdict = "" if row.logged is None else ("  same" if row.same else "  DIFFERENT")
        lines.append(f"  {row.name:<16}{row.replayed:>18.9g}{logged:>18}{verdict}")
    if result.metrics.get(NONFINITE):
        lines.append("the step's loss or gradients are not finite: the method applied no update")
    compared = [row for row in rows if row.logged is not None]
    different = [row.name for row in compared if not row.same]
    if different:
        lines.append(f"replay DIFFERS from the logged step {result.step}: {', '.join(different)}")
    elif compared and compared[0].tolerance is None:
        lines.append(f"replay matches the logged step {result.step} ({len(compared)} metrics, bitwise as float32)")
    elif compared:
        lines.append(f"replay matches the logged step {result.step} ({len(compared)} metrics within "
                     f"{compared[0].tolerance:g} relative: the run used {result.run_world} processes, this replay 1, "
                     "so reductions over ranks add in another order)")
    else:
        lines.append(f"step {result.step} was not logged (run.log_every?, or the event files lost it): nothing to "
                     "compare")
    return "\n".join(lines)
