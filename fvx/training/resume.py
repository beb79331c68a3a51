"""Resume: which checkpoint ``--resume`` names, the config a resumed run continues with, and restoring its state
(an intact checkpoint, or with ``--resume last-good`` the newest intact one, damaged newer ones moved aside).

A resumed run is the uninterrupted one: keys derive from the run seed and the step, the data order from the seed, so a
checkpoint holds only the state. Its config is the one saved with the checkpoint, with this launch's overrides on
top; resuming within a run folder from a step older than its newest checkpoint, or from elsewhere into a folder that
holds checkpoints, is refused (the checkpoints would mix two histories).
"""
from __future__ import annotations

import pathlib
import re
from typing import Any, NamedTuple, Sequence

import msgspec

from fvx import config as fconfig
from fvx.core.state import TrainState
from fvx.storage import checkpoint
from fvx.training import run_folder

LAST_GOOD = "last-good"  # --resume last-good: from the newest intact checkpoint, the damaged newer ones moved aside
IGNORED_CHANGES = ("run.output_dir", "run.progress")  # fields a resumed launch may change without a note
MODEL_FIELDS = re.compile(r"models\.[^.]+\.(preset|lora)(\.|$)")  # what makes a model another: a resume keeps them


class Restored(NamedTuple):
    """A state restored from a checkpoint: where it came from, the updates skipped before it, and what this launch's
    config changes of the checkpoint's (``"field: checkpoint value -> this run's value"``)."""

    state: TrainState
    folder: pathlib.Path
    nonfinite_skips: int
    changes: tuple[str, ...]


def open_checkpoints(folder: pathlib.Path, mesh: Any = None,
                     config: checkpoint.CheckpointConfig | None = None) -> checkpoint.Checkpoints:
    """The run's checkpoints in ``folder`` (writable with ``config``): of local shards on a multi-process run's mesh
    (every rank calls this, and then every method, alike), else of whole tensors."""
    return checkpoint.Checkpoints(folder, config, mesh=mesh)


def find_checkpoint(run_dir: pathlib.Path, resume: str) -> tuple[pathlib.Path, int]:
    """(checkpoints folder, step) that ``--resume`` names: ``latest`` (the newest in ``run_dir``), a step number (in
    ``run_dir``), or a path to a checkpoint folder (``.../checkpoints/N``), a checkpoints folder or a run folder (the
    newest there). Resuming within ``run_dir`` from a step older than its newest checkpoint, or from elsewhere into a
    ``run_dir`` that holds checkpoints, is an error: the checkpoints would mix two histories."""
    own = run_dir / run_folder.CHECKPOINTS
    if resume == "latest" or resume.isdigit():
        folder, step = own, None if resume == "latest" else int(resume)
    else:
        path = pathlib.Path(resume)
        if not path.exists():
            raise checkpoint.CheckpointError(f"--resume {resume!r}: no such checkpoint, step number or folder")
        if path.name.isdigit() and any((path / item).is_dir() for item in checkpoint.STATE_ITEMS):
            folder, step = path.parent, int(path.name)
        elif (path / run_folder.CHECKPOINTS).is_dir():
            folder, step = path / run_folder.CHECKPOINTS, None
        else:
            folder, step = path, None
    with checkpoint.Checkpoints(folder) as checkpoints:
        steps = checkpoints.steps()
    if not steps:
        raise checkpoint.CheckpointError(f"no checkpoint to resume from in {str(folder)!r}")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise checkpoint.CheckpointError(f"--resume {resume}: no checkpoint of step {step} in {str(folder)!r} "
                                         f"(complete checkpoints: {', '.join(map(str, steps))})")
    if folder.resolve() != own.resolve():
        check_no_checkpoints(own)
    later = [s for s in steps if s > step]
    if later and folder.resolve() == own.resolve():
        raise checkpoint.CheckpointError(
            f"--resume {resume}: {str(own)!r} holds later checkpoints ({', '.join(map(str, later))}); resuming from "
            f"step {step} here would mix two histories. Resume into a new folder (--out NEW --resume "
            f"{own / str(step)}) or delete the later checkpoints first")
    return folder, step


def has_checkpoints(out: pathlib.Path) -> bool:
    """Whether the run folder ``out`` holds a committed checkpoint."""
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as checkpoints:
        return bool(checkpoints.steps())


def check_no_checkpoints(folder: pathlib.Path) -> None:
    """A fresh run must not start in a folder whose checkpoints it would mix with its own."""
    with checkpoint.Checkpoints(folder) as checkpoints:
        steps = checkpoints.steps()
    if steps:
        raise checkpoint.CheckpointError(
            f"{str(folder)!r} already holds checkpoints ({', '.join(map(str, steps))}): continue that run with "
            "--resume, or start this one in another folder")


def _named(run_dir: pathlib.Path, resume: str) -> tuple[pathlib.Path, int]:
    """The checkpoint ``--resume`` names; ``last-good`` starts from the newest."""
    return find_checkpoint(run_dir, "latest" if resume == LAST_GOOD else resume)


def resumed_config(config: Any, overrides: Sequence[str], resume: str) -> tuple[Any, tuple[str, ...]]:
    """The config a ``--resume`` continues with: the one saved with the checkpoint it resumes from (read into
    ``config``'s type: the experiment file's), with this launch's ``overrides`` applied on top; and what they change
    (``"field: saved -> now"``). ``config`` (the file's config with the overrides) only says where the run folder
    is."""
    folder, step = _named(pathlib.Path(config.run.output_dir), str(resume))
    with checkpoint.Checkpoints(folder) as checkpoints:
        try:
            saved = checkpoints.read_json(step, "config").get("config")
        except checkpoint.CheckpointMismatch:
            raise
        except checkpoint.CheckpointError as damage:  # the newest whose config record is intact
            older = [s for s in checkpoints.steps() if s < step][::-1]
            intact = next((s for s in older if _config_reads(checkpoints, s)), None)
            if resume != LAST_GOOD or intact is None:
                raise _damaged(damage, intact) from None
            saved = checkpoints.read_json(intact, "config").get("config")
    if not isinstance(saved, dict):
        return config, ()  # a checkpoint without its config: the experiment file's, as given
    try:
        base = msgspec.convert(saved, type(config))
    except msgspec.ValidationError as error:
        raise fconfig.ConfigError(f"the config saved with checkpoint {folder / str(step)} does not fit the experiment "
                                  f"file's config any more: {error}") from None
    resumed = fconfig.apply_overrides(base, overrides)
    carried = carried_fields(resumed)
    for path, old, new in fconfig.differences(saved, _as_json(resumed)):
        if MODEL_FIELDS.match(path):
            raise fconfig.ConfigError(f"this launch changes {path}: {old!r} -> {new!r}, but the checkpoint it resumes "
                                      f"from ({folder / str(step)}) holds the state of the run's models; a resumed "
                                      "run keeps them (train another model in a new run folder)")
        if any(path == field or path.startswith(field + ".") for field in carried):
            raise fconfig.ConfigError(f"this launch changes {path}: {old!r} -> {new!r}, but the checkpoint it resumes "
                                      f"from ({folder / str(step)}) carries the method's state across steps (a "
                                      "stream's cache and latents) made for the saved value: the carried state no "
                                      "longer fits; resume without the change, or start a new run")
    if resumed.run.steps < step:
        raise fconfig.ConfigError(f"run.steps = {resumed.run.steps} is below step {step} of the checkpoint it resumes "
                                  f"from ({folder / str(step)}): a resumed run goes on from there, so ask for "
                                  f"run.steps >= {step} (--steps {step} or more)")
    return resumed, _changes(saved, resumed)


def carried_fields(config: Any) -> tuple[str, ...]:
    """The config fields (dotted paths) the method's carried state is shaped by (``config.method.carried_fields``,
    given the experiment's config; none for a method that carries nothing): a resume may not change them."""
    fields = getattr(config.method, "carried_fields", None)
    return () if fields is None else tuple(fields(config))


def _as_json(config: Any) -> Any:
    """``config`` as JSON holds it (tuples are lists), to compare with a saved record."""
    return msgspec.json.decode(msgspec.json.encode(config))


def _changes(saved: Any, config: Any) -> tuple[str, ...]:
    """``"field: saved -> now"`` for every field ``config`` changes of the ``saved`` record."""
    return tuple(f"{path}: {old!r} -> {new!r}" for path, old, new in fconfig.differences(saved, _as_json(config))
                 if path not in IGNORED_CHANGES)


def _config_reads(checkpoints: checkpoint.Checkpoints, step: int) -> bool:
    try:
        checkpoints.read_json(step, "config")
    except checkpoint.CheckpointError:
        return False
    return True


def _damaged(damage: checkpoint.CheckpointError, intact: int | None) -> checkpoint.CheckpointError:
    """The error of a damaged checkpoint: what is damaged, and the newest intact one (to resume with last-good)."""
    if intact is None:
        return checkpoint.CheckpointError(f"{damage}; no older checkpoint is intact either")
    return checkpoint.CheckpointError(f"{damage}; the newest intact checkpoint is {intact}: resume from it with "
                                      f"--resume {LAST_GOOD} (the damaged ones are moved aside, not deleted)")


def restore_intact(checkpoints: checkpoint.Checkpoints, step: int, target: TrainState, *,
                   move_damaged: bool) -> tuple[int, TrainState]:
    """``(step, state)`` restored from checkpoint ``step``. When it is damaged: with ``move_damaged``, the newest
    intact older one, every damaged newer one renamed ``<step>.damaged`` (never deleted); else a CheckpointError
    naming the damaged one and the newest intact one."""
    try:
        return step, checkpoints.restore(step, target)
    except checkpoint.CheckpointMismatch:
        raise  # not damage: the run's config or model differs from the checkpoint's
    except checkpoint.CheckpointError as damage:
        older = [s for s in checkpoints.steps() if s < step]
        for candidate in reversed(older):
            try:
                state = checkpoints.restore(candidate, target)
            except checkpoint.CheckpointError:
                continue
            if not move_damaged:
                raise _damaged(damage, candidate) from None
            for bad in [s for s in checkpoints.steps() if s > candidate]:
                checkpoints.path(bad).rename(checkpoints.path(bad).with_name(f"{bad}.damaged"))
            return candidate, state
        raise _damaged(damage, None) from None


def restore(config: Any, target: TrainState, resume: str | int, *, mesh: Any = None,
            move_damaged: bool = True) -> Restored:
    """The state of the checkpoint ``resume`` names (``last-good``: the newest intact one, the damaged newer ones
    moved aside when ``move_damaged``), restored into ``target``'s structure (local shards on ``mesh``)."""
    last_good = str(resume) == LAST_GOOD
    folder, step = _named(pathlib.Path(config.run.output_dir), str(resume))
    with open_checkpoints(folder, mesh) as checkpoints:
        step, state = restore_intact(checkpoints, step, target, move_damaged=last_good and move_damaged)
        meta = checkpoints.read_json(step, "meta")
        saved = checkpoints.read_json(step, "config").get("config", {})
    return Restored(state, folder / str(step), int(meta.get("nonfinite_skips", 0)), _changes(saved, config))
