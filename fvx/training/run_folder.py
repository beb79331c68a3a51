"""The run folder: what it holds, the history of its launches, and the config a run was trained with.

The run folder (``run.output_dir``)::

    config.json        the resolved config (fvx.config.dump); the source of truth for values
    run.json           every launch: how it was started (experiment file, overrides, versions, world size), the step
                       it started from and the config it ran with
    tb/                TensorBoard events, one value per step (a resumed run first drops the events of the steps it
                       takes again, e.g. those a killed run logged after its last checkpoint)
    checkpoints/<N>/   the state after N steps, with the config and the launch's metadata (fvx.storage.checkpoint)
    validation/        validation videos by step (fvx.training.validation)
    nonfinite.json     the step whose loss or gradients were not finite, when the run halted there

A run folder is data: :func:`load_run` types its config from ``config.json``'s own class records, never importing
or running a file the folder names, unless the caller names an experiment file.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import sys
import tempfile
from typing import Any, Callable

import msgspec
import torch

import fvx
from fvx import config as fconfig
from fvx.storage import files
from fvx.training import tracking

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"
NONFINITE_FILE = "nonfinite.json"
EXPERIMENT_FIELDS = ("run", "data", "models", "method")  # what every experiment's config holds


class Launch(msgspec.Struct, frozen=True):
    """How a run was started (recorded in run.json and in every checkpoint): the experiment file's absolute path and
    the command-line overrides. Re-running the file gives the config's type; config.json gives its values."""

    experiment: str | None = None
    overrides: tuple[str, ...] = ()


def check_writable(out: pathlib.Path) -> None:
    """A ValueError naming ``out`` when the run folder cannot be made or written, checked before anything is: the
    nearest existing folder must be one a folder can be made in (tried with an empty one, removed at once: file
    systems such as /proc refuse what the permission bits allow)."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"run.output_dir {str(out)!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"run.output_dir {str(out)!r}: {str(existing)!r} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fvx-probe-", dir=existing))
    except OSError as error:
        raise ValueError(f"run.output_dir {str(out)!r}: no folder can be made in {str(existing)!r} "
                         f"({error.strerror or type(error).__name__})") from None


def metadata(launch: Launch, world: int) -> dict[str, Any]:
    """One launch's record (in run.json and every checkpoint it saves): how it was started (with the experiment
    file's sha256), and the versions and world size it ran with."""
    versions = {"fvx": fvx.__version__, "torch": torch.__version__}
    for package in ("diffusers", "orbax-checkpoint"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"experiment": launch.experiment, "experiment_sha256": _experiment_hash(launch.experiment),
            "overrides": list(launch.overrides), "world_size": world, **versions}


def _experiment_hash(experiment: str | None) -> str | None:
    if experiment is None:
        return None
    path, _ = fconfig.split_recipe(experiment)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def begin(out: pathlib.Path, config: Any, meta: dict[str, Any], record: dict[str, Any], start: int) -> None:
    """A launch starting at step ``start``, written to the run folder: config.json, run.json (the launches it
    continues, then this one), and the TensorBoard events of the steps it takes again dropped (damaged records
    reported)."""
    fconfig.dump(config, out)
    history = [entry for entry in launches(out) if entry.get("start_step", 0) < start]  # those it continues
    history.append({**meta, "start_step": start, "config": record})
    files.write_json(out / RUN_FILE, {"launches": history, "crc32": files.json_checksum(history)})
    if (out / TENSORBOARD).is_dir():
        tracking.truncate_events(out / TENSORBOARD, start, report=lambda line: print(line, file=sys.stderr))
        tracking.wait_for_a_new_second(out / TENSORBOARD)


def record_nonfinite(out: pathlib.Path, record: dict[str, Any]) -> None:
    """The step that halted the run on a non-finite loss or gradient, for people and tools."""
    files.write_json(out / NONFINITE_FILE, record)


def launches(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The launches of a run folder, oldest first (run.json's ``launches``: each launch's record, its ``start_step``
    and the ``config`` it ran with); none without run.json. A damaged run.json (not JSON, or failing the CRC-32 it
    was written with; run folders of fvx 0.1 have none) is a one-line ConfigError naming it and what to do."""
    path = pathlib.Path(run_dir) / RUN_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _damaged(path, f"not valid JSON: {error}") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "not a record of launches")
    history = list(meta.get("launches", [meta]))
    if "crc32" in meta and files.json_checksum(history) != meta["crc32"]:
        raise _damaged(path, "it fails the checksum it was written with")
    return history


def _damaged(path: pathlib.Path, why: str) -> fconfig.ConfigError:
    return fconfig.ConfigError(f"{str(path)!r} is damaged ({why}); it holds the run's history of launches: restore it "
                               "from a copy, or move it aside to go on without that history")


def launch_at(run_dir: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """The launch that ran step ``step`` (the last whose ``start_step`` is at most ``step``; None: the last)."""
    history = launches(run_dir)
    if step is not None:
        history = [entry for entry in history if entry.get("start_step", 0) <= step] or history[:1]
    return history[-1] if history else {}


def load_run(run_dir: str | os.PathLike, step: int | None = None, experiment: str | None = None) -> Any:
    """The config a run folder was trained with (:func:`load_run_sources`)."""
    return load_run_sources(run_dir, step, experiment).config


def load_run_sources(run_dir: str | os.PathLike, step: int | None = None,
                     experiment: str | None = None) -> fconfig.Loaded:
    """The config a run folder was trained with at step ``step`` (the launch that ran it; None: the last launch's,
    config.json), read as data only: fvx's classes by their recorded names, the classes an experiment file defined
    rebuilt from the record (values kept, no code run) unless the caller names that file (``experiment``, as a user
    does on the command line), whose classes are then used. Nothing a run folder records is ever imported or run.
    ``sources`` says where each class came from."""
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / fconfig.CONFIG_FILE).is_file():
        raise fconfig.ConfigError(f"{str(run_dir)!r} is not an fvx run folder (it has no {fconfig.CONFIG_FILE})")
    meta = launch_at(run_dir, step)
    notes: list[str] = []
    classes = None
    if experiment is not None:
        if _experiment_hash(experiment) is None:
            raise fconfig.ConfigError(f"--experiment {experiment!r}: no such file")
        if meta.get("experiment_sha256") not in (None, _experiment_hash(experiment)):
            notes.append(f"the experiment file {experiment!r} differs from the one the run used (sha256)")
        classes = _classes_of(experiment)
    record = meta.get("config") if step is not None and "config" in meta else None
    loaded = (fconfig.load_typed(run_dir, classes) if record is None
              else fconfig.from_record(record, classes, run_dir / RUN_FILE))
    if not all(hasattr(loaded.config, field) for field in EXPERIMENT_FIELDS):
        raise fconfig.ConfigError(f"{str(run_dir)!r} holds a {type(loaded.config).__qualname__}, not an experiment "
                                  f"(fvx.training.experiment.Experiment: {', '.join(EXPERIMENT_FIELDS)})")
    return fconfig.Loaded(loaded.config, tuple(notes) + loaded.sources)


def _classes_of(experiment: str) -> Callable[[str], type | None]:
    """``"module:QualName" -> class`` of the experiment file, run once when first asked."""
    namespace: dict[str, Any] = {}

    def lookup(spec: str) -> type | None:
        if not namespace:
            path, _ = fconfig.split_recipe(experiment)
            namespace.update(fconfig.run_experiment(path))
        module, _, qualname = spec.partition(":")
        value: Any = namespace if namespace.get("__name__") == module else None
        for attr in qualname.split(".") if value is not None else ():
            value = value.get(attr) if isinstance(value, dict) else getattr(value, attr, None)
        return value if isinstance(value, type) else None

    return lookup
