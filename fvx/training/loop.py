"""The training loop: take the batch, run the program's step, log, checkpoint, validate, show progress. It knows no
model family and no method; what it runs was built by ``fvx.training.experiment.prepare``.

Step numbering. Step ``s`` (0-based) is the update that consumes ``batch_at(s)`` with the step key ``fold_in(key, s)``;
TensorBoard shows its metrics at ``s``. Afterwards the state's ``step`` is ``s + 1``, and a checkpoint taken then is
checkpoint ``s + 1``: the state that step ``s + 1`` starts from. Nothing else is needed to resume or to recompute any
step (fvx.training.replay), since keys derive from the step and the data order from the seed.

Non-finite steps. A step whose loss or gradients are not finite halts the run (``run.on_nonfinite=halt``, after
recording the replay command in ``nonfinite.json``), or is skipped (``skip``: the method applied nothing), until more
than ``run.max_consecutive_skips`` are skipped in a row. SIGTERM or SIGINT: the step in flight finishes, is saved, and
:class:`Interrupted` stops the run (every rank alike); during the start-of-run hooks (validation), they finish and the
state the run started from is saved.
"""
from __future__ import annotations

import contextlib
import math
import pathlib
import shlex
import signal
import time
from typing import Any, Callable, NamedTuple

import msgspec

from fvx import config as fconfig
from fvx.core import tree
from fvx.core.state import NONFINITE, TrainState
from fvx.data import batching
from fvx.distributed.processes import any_rank
from fvx.storage import checkpoint_config
from fvx.training import callbacks as fcallbacks, resume, run_folder, run_lock, tracking, validation
from fvx.training.experiment import batch_fn, Experiment, Prepared, Setup
from fvx.training.interrupts import Interrupted, Signals
from fvx.training.run_folder import Launch
from fvx.training.wandb_mirror import WandbMirror


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite and the run halted; ``step`` and ``replay_command`` say where."""

    def __init__(self, message: str, step: int, replay_command: str):
        super().__init__(message)
        self.step = step
        self.replay_command = replay_command


def train(config: Experiment, prepared: Prepared, *, launch: Launch = Launch(), rank: int = 0,
          world: int = 1) -> TrainState:
    """Run from the prepared state (step 0, or a restored checkpoint) to ``config.run.steps``: take the run folder's
    lock, record the launch, then :func:`run_steps` with the checkpoints, the tracker and the callbacks (validation
    among them) open; return the final state. Rank 0 logs and writes the run folder; every rank of a sharded run
    writes its checkpoint shards. Raises :class:`NonFiniteError` when a step's loss or gradients are not finite and
    ``run.on_nonfinite`` is ``halt`` (or the method could not skip the update)."""
    out = pathlib.Path(config.run.output_dir)
    start, meta = int(prepared.state.step), run_folder.metadata(launch, world)
    log_hparams = start == 0 or not (out / run_folder.TENSORBOARD).is_dir()  # a resumed run logged them at step 0
    with run_lock.held(out) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            run_folder.begin(out, config, meta, fconfig.record(config), start)
        with _checkpoints(config, prepared, rank, world) as checkpoints, _tracker(config, rank) as tracker:
            if rank == 0 and log_hparams:
                tracker.hparams(msgspec.to_builtins(config))
            hooks = _hooks(prepared)

            def context(state: TrainState, metrics: dict[str, float]) -> fcallbacks.Context:
                return fcallbacks.Context(int(state.step), state, prepared.frozen, metrics, tracker, out)

            with Signals() as signals:
                fcallbacks.call(hooks, "on_train_start", context(prepared.state, {}))  # start-of-run validation
                _stop_if_signalled(signals, config, prepared.state, checkpoints, meta, prepared.nonfinite_skips,
                                   world)
                state = run_steps(config, prepared.setup, prepared.state, prepared.frozen,
                                  range(start, config.run.steps), tracker, signals, checkpoints=checkpoints, meta=meta,
                                  nonfinite_skips=prepared.nonfinite_skips,
                                  after_step=lambda state, metrics: fcallbacks.call(hooks, "on_step_end",
                                                                                    context(state, metrics)),
                                  rank=rank, world=world)
            if config.run.steps > start:  # a finished run resumed logs no second summary
                log_run_summary(tracker, state, compile_stats(prepared.setup), config.run.steps - 1)
            fcallbacks.call(hooks, "on_train_end", context(state, {}))
    return state


def _stop_if_signalled(signals: Signals, config: Experiment, state: TrainState, checkpoints: Any,
                       meta: dict[str, Any], nonfinite_skips: int, world: int) -> None:
    """After the start-of-run hooks: a signal received while they ran (validation can take minutes) saves the
    state the run started from, as a step in flight would be saved, and stops with :class:`Interrupted`."""
    received = signals.received is not None
    if world > 1:  # every rank stops (and saves its shards) alike
        received = any_rank(received)
    if not received:
        return
    if checkpoints is not None:
        _save(checkpoints, state, config, meta, nonfinite_skips)
    raise Interrupted(int(state.step), signals.received or signal.SIGTERM)


def _save(checkpoints: Any, state: TrainState, config: Experiment, meta: dict[str, Any] | None,
          nonfinite_skips: int) -> None:
    """Save ``state`` as checkpoint ``state.step`` (nothing when that step is saved already)."""
    checkpoints.save(state, config=fconfig.record(config), meta={**(meta or {}), "nonfinite_skips": nonfinite_skips})


def _checkpoints(config: Experiment, prepared: Prepared, rank: int, world: int):
    """The run's checkpoints, open for saving (every rank of a sharded run saves its shards), or nothing when this
    rank saves none."""
    saves, folder = config.run.checkpoint, pathlib.Path(config.run.output_dir) / run_folder.CHECKPOINTS
    if (rank == 0 or world > 1) and (saves.every or saves.final):
        return resume.open_checkpoints(folder, prepared.setup.mesh, saves)
    return contextlib.nullcontext()


def _tracker(config: Experiment, rank: int) -> tracking.Tracker:
    """TensorBoard on rank 0 (and Weights & Biases when ``run.wandb`` says so)."""
    out, wandb = pathlib.Path(config.run.output_dir), config.run.wandb
    mirrors = (lambda: ()) if wandb is None else (lambda: (WandbMirror(wandb, out),))
    return tracking.open_tracker(out / run_folder.TENSORBOARD, rank=rank, mirrors=mirrors)


def _hooks(prepared: Prepared) -> tuple[fcallbacks.Callback, ...]:
    """The experiment's callbacks, then validation (which brackets itself with their validation hooks)."""
    hooks, validator = prepared.callbacks, prepared.validator
    if validator is None:
        return hooks
    return fcallbacks.check(hooks + (validation.callback(validator, prepared.setup.program.validate, hooks),))


# ------------------------------------------------------------------------------------------------------------ the loop


class Skips(NamedTuple):
    """Non-finite steps skipped so far, and how many of them in a row up to the last step."""

    total: int = 0
    in_a_row: int = 0

    def after(self, skipped: bool) -> Skips:
        return Skips(self.total + skipped, self.in_a_row + 1 if skipped else 0)


def run_steps(config: Experiment, built: Setup, state: TrainState, frozen: dict[str, Any], steps: range,
              tracker: tracking.Tracker, signals: Signals, *, checkpoints: Any = None,
              meta: dict[str, Any] | None = None,
              after_step: Callable[[TrainState, dict[str, float]], None] | None = None, nonfinite_skips: int = 0,
              rank: int = 0, world: int = 1) -> TrainState:
    """Take ``steps`` with ``built.program.step_`` (the frozen roles' params ``frozen``) on prefetched batches: log
    every ``run.log_every`` (and every non-finite step), save to ``checkpoints`` (with ``meta``) after each step a
    checkpoint is due (by step count or ``every_seconds``, or a signal ``signals`` received), then
    ``after_step(state, metrics)`` (the callbacks' ``on_step_end``: validation); a failed background save is raised
    at the next step."""
    run, skips, last_save = config.run, Skips(nonfinite_skips), time.monotonic()
    batches = batching.Prefetcher(batch_fn(config, built, rank=rank, world=world), steps, depth=config.data.prefetch)
    with batches, _progress_bar(config, steps, rank) as progress:
        for step, batch in batches:
            began = time.perf_counter()
            state, metrics = built.program.step_(state, frozen, batch)
            values = {name: float(value) for name, value in metrics.items()}  # waits for the step
            elapsed = time.perf_counter() - began
            flagged = values.pop(NONFINITE, 0.0) != 0.0  # the method applied nothing
            nonfinite = flagged or not all(math.isfinite(v) for v in values.values())
            skipped = nonfinite and flagged and run.on_nonfinite == "skip"
            skips = skips.after(skipped)
            if nonfinite or step % run.log_every == 0 or step == steps.stop - 1:
                counted = {"nonfinite_skips": skips.total} if run.on_nonfinite == "skip" else {}
                tracker.scalars(step, {**values, tracking.STEP_RECORD: elapsed,
                                       "samples_per_s": config.data.batch_size / elapsed, **counted})
            if (nonfinite and not skipped) or skips.in_a_row > run.max_consecutive_skips:
                tracker.flush()
                raise _halt(config, step, values, applied=not flagged, rank=rank, skips=skips,
                            experiment=(meta or {}).get("experiment"), samples=batching.suspects(batch, built.dataset))
            if checkpoints is not None:
                checkpoints.poll()
            timed = run.checkpoint.every_seconds is not None and \
                time.monotonic() - last_save >= run.checkpoint.every_seconds
            stop = signals.received is not None
            if world > 1:  # every rank must save and stop at the same step
                timed, stop = any_rank(timed), any_rank(stop)
            if checkpoints is not None and (checkpoint_config.due(run.checkpoint, step + 1, run.steps) or timed
                                            or stop):
                _save(checkpoints, state, config, meta, skips.total)
                last_save = time.monotonic()
            if stop:
                raise Interrupted(step + 1, signals.received or signal.SIGTERM)
            if after_step is not None:
                after_step(state, values)
            if progress is not None:
                progress.set_postfix({name: f"{value:.4g}" for name, value in values.items()
                                      if name.endswith("loss")}, refresh=False)
                progress.update(1)
    return state


def _halt(config: Experiment, step: int, values: dict[str, float], *, applied: bool, rank: int, skips: Skips,
          experiment: str | None = None, samples: tuple[list[str], bool] = ([], False)) -> NonFiniteError:
    """Record the non-finite step in the run folder and make the error that stops the run; ``samples`` are the
    step's suspects (``batching.suspects``: its samples with non-finite data, else all it read)."""
    out = config.run.output_dir
    command = f"python -m fvx.run replay {shlex.quote(out)} --step {step}"
    if fconfig.foreign_classes(config) and experiment is not None:  # their code (not only their values) decides
        command += f" --experiment {shlex.quote(experiment)}"
    shown = ", ".join(f"{name}={value:.6g}" for name, value in values.items())
    if skips.in_a_row > config.run.max_consecutive_skips:
        why = (f"{skips.in_a_row} steps in a row were skipped, more than run.max_consecutive_skips="
               f"{config.run.max_consecutive_skips}")
    elif applied:
        why = ("the method applied the update anyway (it reports no 'nonfinite' flag; see fvx.core.state.skipped), so "
               "the state is spoiled and the step cannot be skipped")
    else:
        why = f"run.on_nonfinite={config.run.on_nonfinite}"
    names, bad_data = samples
    read = ("" if not names else f"; non-finite data in {_listed(names)}" if bad_data
            else f"; its data is finite (samples {_listed(names)})")
    if rank == 0:
        run_folder.record_nonfinite(pathlib.Path(out), {"step": step, "metrics": values, "update_applied": applied,
                                                         "samples": names, "nonfinite_data": bad_data,
                                                         "replay": command})
    return NonFiniteError(f"step {step}: non-finite loss or gradient ({shown}){read}; the run halted ({why}). "
                          f"Replay the step with: {command}", step, command)


def _listed(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


@contextlib.contextmanager
def _progress_bar(config: Experiment, steps: range, rank: int):
    if rank != 0 or not config.run.progress:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=steps.stop, initial=steps.start, desc="train", unit="step", dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


# --------------------------------------------------------------------------------------------------------- summary


class CompiledGraphs(NamedTuple):
    graphs: int
    recompiles: int


def compile_stats(built: Setup) -> CompiledGraphs | None:
    """The compiled graphs of all the run's models together (each model built once), or None when none compiles."""
    counters = (m.kernels.compile_stats for m in built.models.values())
    stats = {id(c): c for c in counters if c is not None}
    if not stats:
        return None
    return CompiledGraphs(sum(s.graphs for s in stats.values()), sum(s.recompiles for s in stats.values()))


def log_run_summary(tracker: tracking.Tracker, state: TrainState, stats: CompiledGraphs | None, step: int) -> None:
    """At the run's last ``step``: ``state_bytes_per_rank`` (what rank 0 holds of the state: its local shards when
    sharded) and, when models compile their units, ``compile/graphs`` and ``compile/recompiles``."""
    if step < 0:
        return
    summary = {"state_bytes_per_rank": sum(x.numel() * x.element_size() for x in tree.tensor_leaves(state))}
    if stats is not None:
        summary.update({"compile/graphs": stats.graphs, "compile/recompiles": stats.recompiles})
    tracker.scalars(step, summary)
