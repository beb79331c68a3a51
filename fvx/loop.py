"""The generic training loop: build, then step, log, checkpoint and show progress. It knows no model family and
no method.

An experiment's root config subclasses :class:`Experiment` and adds ``models`` (model name -> a model config, whose
``build(mesh=)`` gives the model interface) and a ``method`` whose ``roles`` (a Struct: role -> model name) say which
model plays each role, and whose ``build(models, total_steps=...)`` (``models``: role -> built model) gives an
``fvx.state.Program``. Each named model is built once, whatever the number of roles it plays.

Step numbering. Step ``s`` (0-based) is the update that consumes ``batch_at(s)`` with the step key ``fold_in(key, s)``;
TensorBoard shows its metrics at ``s``. Afterwards the state's ``step`` is ``s + 1``, and a checkpoint taken then is
checkpoint ``s + 1``: the state that step ``s + 1`` starts from. Nothing else is needed to resume or to recompute any
step (fvx.replay), since keys derive from the step and the data order from the seed.

The run folder (``run.output_dir``)::

    config.json        the resolved config (fvx.config.dump); the source of truth for values
    run.json           how the run was started: experiment file (absolute), overrides, versions, world size
    tb/                TensorBoard events, one value per step (a resumed run first drops the events of the steps it
                       takes again, e.g. those a killed run logged after its last checkpoint)
    checkpoints/<N>/   the state after N steps, with the config and run.json's metadata (fvx.checkpoint)
    nonfinite.json     the step whose loss or gradients were not finite, when the run halted there
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import pathlib
import shlex
import signal
import sys
import time
from typing import Annotated, Any, Callable, Literal, NamedTuple, Sequence

import msgspec
import torch

import fvx
from fvx import callbacks as fcallbacks
from fvx import checkpoint
from fvx import config as fconfig
from fvx import data, files, random, run_lock, tracking, tree, validation
from fvx import role as fvx_role
from fvx.config import Config
from fvx.interrupts import Interrupted, Signals
from fvx import sequence_parallel
from fvx.sharding import any_rank, data_rank, sequence_group
from fvx.state import NONFINITE, Program, TrainState
from fvx.wandb_mirror import WandbConfig, WandbMirror, check_available

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"
NONFINITE_FILE = "nonfinite.json"


class RunConfig(Config):
    """Where a run writes, how long it runs, its seed (every key of the run derives from it), how it checkpoints,
    what a non-finite loss or gradient does (``halt`` the run, or ``skip`` the update: the step still counts; more
    than ``max_consecutive_skips`` skips in a row halt it), and
    whether Weights & Biases mirrors the TensorBoard logs (``wandb``; None: TensorBoard only)."""

    seed: int = 0
    steps: Annotated[int, msgspec.Meta(ge=0)] = 100
    output_dir: str = "runs/default"
    log_every: Annotated[int, msgspec.Meta(ge=1)] = 1
    progress: bool = True
    on_nonfinite: Literal["halt", "skip"] = "halt"
    max_consecutive_skips: Annotated[int, msgspec.Meta(ge=1)] = 20
    checkpoint: checkpoint.CheckpointConfig = checkpoint.CheckpointConfig()
    wandb: WandbConfig | None = None


class Experiment(Config):
    """The root of an experiment config; subclasses add ``models`` and ``method`` (module docstring), and may override
    :meth:`callbacks` to add lifecycle hooks (``fvx.callbacks``). A field ``vae`` (a config with ``build(key)``)
    decodes validation samples into videos; without one, validation logs latent previews."""

    run: RunConfig = RunConfig()
    data: data.DataConfig = data.DataConfig()
    validation: validation.ValidationConfig = validation.ValidationConfig()

    def build_vae(self) -> Any:
        """The decoder of validation samples: the experiment's ``vae`` config built from the validation seed (an
        object with ``decode(latents) -> video``), or None without one."""
        vae = getattr(self, "vae", None)
        return None if vae is None else vae.build(random.key(self.validation.seed))

    def callbacks(self) -> tuple[fcallbacks.Callback, ...]:
        """The run's callbacks besides validation (which the loop adds), run in order."""
        return ()


class Launch(msgspec.Struct, frozen=True):
    """How a run was started (recorded in run.json and in every checkpoint): the experiment file's absolute path and
    the command-line overrides. Re-running the file gives the config's type; config.json gives its values."""

    experiment: str | None = None
    overrides: tuple[str, ...] = ()


class Setup(msgspec.Struct, frozen=True):
    """Everything a run builds from its config before the first step: the models by role, the method's program, the
    dataset, and the keys."""

    models: dict[str, Any]
    program: Program
    dataset: Any
    data_key: torch.Tensor
    method_key: torch.Tensor
    mesh: Any = None  # the device mesh of a multi-process run (fvx.sharding.make_mesh), else None


class Prepared(NamedTuple):
    """A run ready to start: what it built, the state it starts from, the frozen roles' params, and, when resumed,
    from where."""

    setup: Setup
    state: TrainState
    frozen: dict[str, Any]
    nonfinite_skips: int = 0  # updates skipped before ``state.step`` (counted on in the logs)
    callbacks: tuple[fcallbacks.Callback, ...] = ()  # the experiment's (``Experiment.callbacks``), made once
    validator: validation.Validator | None = None  # the run's fixed validation prompts and noise (None: off)
    resumed_from: pathlib.Path | None = None  # the checkpoint folder the state came from
    config_changes: tuple[str, ...] = ()  # "field: checkpoint value -> this run's value", where they differ


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite and the run halted; ``step`` and ``replay_command`` say where."""

    def __init__(self, message: str, step: int, replay_command: str):
        super().__init__(message)
        self.step = step
        self.replay_command = replay_command


# ---------------------------------------------------------------------------------------------------------- building


def role_configs(config: Experiment) -> dict[str, Any]:
    """Role -> the model config that plays it (``config.method.roles`` names models of ``config.models``); a
    ConfigError names a role whose model the experiment does not define."""
    roles = msgspec.structs.asdict(config.method.roles)
    for role, name in roles.items():
        if name not in config.models:
            raise fconfig.ConfigError(f"method.roles.{role} names model {name!r}, which the experiment does not "
                                      f"define (models: {', '.join(config.models) or 'none'})")
    return {role: config.models[name] for role, name in roles.items()}


def build_models(config: Experiment, *, mesh: Any = None) -> dict[str, Any]:
    """Role -> built model: each named model of ``config.models`` that plays a role is built once (on ``mesh``)."""
    built: dict[str, Any] = {}
    roles = msgspec.structs.asdict(config.method.roles)
    role_configs(config)  # every role names a model
    on_mesh = {} if mesh is None else {"mesh": mesh}
    for name in dict.fromkeys(roles.values()):
        built[name] = config.models[name].build(**on_mesh)
    return {role: built[name] for role, name in roles.items()}


def setup(config: Experiment, *, mesh: Any = None, callbacks: tuple[fcallbacks.Callback, ...] = ()) -> Setup:
    """Build the models, the method's program (its ``before_update`` running the callbacks'
    ``on_before_optimizer_step``) and the dataset (the experiment's, as the program's ``dataset`` makes it the data
    its steps read); keys are :func:`run_keys`. On a device mesh (a multi-process run) the models and the method are
    built on it."""
    method_key, data_key = run_keys(config.run.seed)
    models = build_models(config, mesh=mesh)
    extra = {} if mesh is None else {"mesh": mesh}
    hook = fcallbacks.before_update(callbacks)
    if hook is not None:
        extra["before_update"] = hook
    program = config.method.build(models, total_steps=config.run.steps, **extra)
    dataset = program.dataset(data.open_dataset(config.data, data_key))
    return Setup(models=models, program=program, dataset=dataset, data_key=data_key, method_key=method_key,
                 mesh=mesh)


def run_keys(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(method_key, data_key) = split(key(seed))``: the method's keys (its state, frozen roles and steps) and the
    data's (sample order, synthetic samples, CFG dropout), for the loop and for tools that rebuild a run's draws."""
    method_key, data_key = random.split(random.key(seed))
    return method_key, data_key


def batch_fn(config: Experiment, built: Setup, *, rank: int = 0, world: int = 1) -> Callable[[int], Any]:
    """``step -> this rank's batch`` as methods see it (the data model's ``cond`` made from the data): a pure function
    of the config's seed. Under sequence parallelism the slice is the data-parallel rank's (``rank // sp`` of
    ``world // sp``): the ranks of an SP group read the same samples."""
    rank, world = data_rank(built.mesh, rank, world)

    def at(step: int):
        raw = data.batch_at(built.dataset, built.data_key, step, batch_size=config.data.batch_size, rank=rank,
                            world=world)
        return built.program.model.batch(raw)
    return at


def check_sequence_parallel(built: Setup, batch: Any) -> None:
    """Under sequence parallelism, a ValueError saying what to change unless the batch's latents ``[B, C, T, H, W]``
    make a token count (after the model's patching) that the SP group splits evenly."""
    sequence, latents = sequence_group(built.mesh), batch.get("latents") if isinstance(batch, dict) else None
    if sequence is None or not isinstance(latents, torch.Tensor) or latents.dim() != 5:
        return
    patch = built.program.model.patch_size
    tokens = math.prod(size // p for size, p in zip(latents.shape[2:], patch))
    try:
        sequence_parallel.local_tokens(tokens, sequence)
    except ValueError as error:
        raise ValueError(f"latents {tuple(latents.shape)} (patch {tuple(patch)}): {error}") from None


def initial_state(built: Setup) -> TrainState:
    """The state a run starts from: a pure function of the config and seed (also the target a checkpoint restores
    into)."""
    return built.program.init(built.method_key)


def frozen_params(built: Setup) -> dict[str, Any]:
    """The frozen roles' params (a teacher, loaded or drawn from the run's keys): made once per run, never saved."""
    return built.program.frozen(built.method_key)


def role_params(config: Experiment, role: str, model: Any, trained: Any) -> Any:
    """Role ``role``'s whole params for ``model``: ``trained`` (its params or EMA from a checkpoint) with the base it
    holds frozen (a LoRA base, an expert left frozen), made as the run made it."""
    if model.base_id() is None:
        return trained
    method_key, _ = run_keys(config.run.seed)
    program = config.method.build(build_models(config), total_steps=config.run.steps)  # no data needed
    return fvx_role.with_trained(program.frozen(method_key)[role], trained)


def prepare(config: Experiment, *, resume: str | int | None = None, rank: int = 0, world: int = 1,
            mesh: Any = None) -> Prepared:
    """Build everything (on ``mesh`` when given), check the first batch against the method, load the frozen roles
    and restore the checkpoint ``resume`` names (see :func:`find_checkpoint`), writing nothing: bad input and
    unusable checkpoints fail here."""
    out = pathlib.Path(config.run.output_dir)
    check_writable(out)
    run_lock.check(out)
    if config.run.wandb is not None and rank == 0:
        check_available()
    callbacks = fcallbacks.check(config.callbacks())
    built = setup(config, mesh=mesh, callbacks=callbacks)
    first = batch_fn(config, built, rank=rank, world=world)(0)
    built.program.check(first)
    check_sequence_parallel(built, first)
    validator = make_validator(config, built, out)
    state = initial_state(built)
    if resume is None:
        _check_no_checkpoints(out / CHECKPOINTS)
        return Prepared(built, state, frozen_params(built), callbacks=callbacks, validator=validator)
    last_good = str(resume) == LAST_GOOD
    folder, step = find_checkpoint(out, "latest" if last_good else str(resume))
    with open_checkpoints(folder, built) as checkpoints:
        step, state = restore_intact(checkpoints, step, state, move_damaged=last_good and rank == 0)
        meta = checkpoints.read_json(step, "meta")
        saved = checkpoints.read_json(step, "config").get("config", {})
    current = msgspec.json.decode(msgspec.json.encode(config))  # as JSON holds it: tuples are lists
    changes = _differences(saved, current, ignore=("run.output_dir", "run.progress"))
    return Prepared(built, state, frozen_params(built), nonfinite_skips=int(meta.get("nonfinite_skips", 0)),
                    resumed_from=folder / str(step), config_changes=tuple(changes), callbacks=callbacks,
                    validator=validator)


def resumed_config(config: Experiment, overrides: Sequence[str], resume: str) -> tuple[Experiment, tuple[str, ...]]:
    """The config a ``--resume`` continues with: the one saved with the checkpoint it resumes from (read into
    ``config``'s type: the experiment file's), with this launch's ``overrides`` applied on top; and what they change
    (``"field: saved -> now"``). ``config`` (the file's config with the overrides) only says where the run folder
    is."""
    last_good = str(resume) == LAST_GOOD
    folder, step = find_checkpoint(pathlib.Path(config.run.output_dir), "latest" if last_good else str(resume))
    with checkpoint.Checkpoints(folder) as checkpoints:
        candidates = [s for s in checkpoints.steps() if s <= step][::-1] if last_good else [step]
        for candidate in candidates:  # last-good: the newest whose config record reads
            try:
                saved = checkpoints.read_json(candidate, "config").get("config")
                break
            except checkpoint.CheckpointError:
                if candidate == candidates[-1]:
                    raise
    if not isinstance(saved, dict):
        return config, ()  # a checkpoint without its config: the experiment file's, as given
    try:
        base = msgspec.convert(saved, type(config))
    except msgspec.ValidationError as error:
        raise fconfig.ConfigError(f"the config saved with checkpoint {folder / str(step)} does not fit the experiment "
                                  f"file's config any more: {error}") from None
    resumed = fconfig.apply_overrides(base, overrides)
    changes = _differences(saved, msgspec.json.decode(msgspec.json.encode(resumed)),
                           ignore=("run.output_dir", "run.progress"))
    return resumed, tuple(changes)


LAST_GOOD = "last-good"  # --resume last-good: from the newest intact checkpoint, the damaged newer ones moved aside


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
                raise checkpoint.CheckpointError(
                    f"{damage}; the newest intact checkpoint is {candidate}: resume from it with --resume "
                    f"{LAST_GOOD} (the damaged ones are moved aside, not deleted)") from None
            for bad in [s for s in checkpoints.steps() if s > candidate]:
                checkpoints.path(bad).rename(checkpoints.path(bad).with_name(f"{bad}.damaged"))
            return candidate, state
        raise checkpoint.CheckpointError(f"{damage}; no older checkpoint is intact either") from None


def check_writable(out: pathlib.Path) -> None:
    """A ValueError naming ``out`` when the run folder cannot be made or written (checked before anything is)."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"run.output_dir {str(out)!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"run.output_dir {str(out)!r}: {str(existing)!r} is not writable")


def open_checkpoints(folder: pathlib.Path, built: Setup,
                     config: checkpoint.CheckpointConfig | None = None) -> checkpoint.Checkpoints:
    """The run's checkpoints in ``folder`` (writable with ``config``): of local shards on a multi-process run's mesh
    (every rank calls this, and then every method, alike), else of whole tensors."""
    return checkpoint.Checkpoints(folder, config, mesh=built.mesh)


def find_checkpoint(run_dir: pathlib.Path, resume: str) -> tuple[pathlib.Path, int]:
    """(checkpoints folder, step) that ``--resume`` names: ``latest`` (the newest in ``run_dir``), a step number (in
    ``run_dir``), or a path to a checkpoint folder (``.../checkpoints/N``), a checkpoints folder or a run folder (the
    newest there). Resuming within ``run_dir`` from a step older than its newest checkpoint, or from elsewhere into a
    ``run_dir`` that holds checkpoints, is an error: the checkpoints would mix two histories."""
    own = run_dir / CHECKPOINTS
    if resume == "latest" or resume.isdigit():
        folder, step = own, None if resume == "latest" else int(resume)
    else:
        path = pathlib.Path(resume)
        if not path.exists():
            raise checkpoint.CheckpointError(f"--resume {resume!r}: no such checkpoint, step number or folder")
        if path.name.isdigit() and ((path / "state").is_dir() or (path / checkpoint.SHARDS_ITEM).is_dir()):
            folder, step = path.parent, int(path.name)
        elif (path / CHECKPOINTS).is_dir():
            folder, step = path / CHECKPOINTS, None
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
        _check_no_checkpoints(own)
    later = [s for s in steps if s > step]
    if later and folder.resolve() == own.resolve():
        raise checkpoint.CheckpointError(
            f"--resume {resume}: {str(own)!r} holds later checkpoints ({', '.join(map(str, later))}); resuming from "
            f"step {step} here would mix two histories. Resume into a new folder (--out NEW --resume "
            f"{own / str(step)}) or delete the later checkpoints first")
    return folder, step


def has_checkpoints(out: pathlib.Path) -> bool:
    """Whether the run folder ``out`` holds a committed checkpoint."""
    with checkpoint.Checkpoints(out / CHECKPOINTS) as checkpoints:
        return bool(checkpoints.steps())


def _check_no_checkpoints(folder: pathlib.Path) -> None:
    """A fresh run must not start in a folder whose checkpoints it would mix with its own."""
    with checkpoint.Checkpoints(folder) as checkpoints:
        steps = checkpoints.steps()
    if steps:
        raise checkpoint.CheckpointError(
            f"{str(folder)!r} already holds checkpoints ({', '.join(map(str, steps))}): continue that run with "
            "--resume, or start this one in another folder")


def _differences(old: Any, new: Any, *, ignore: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """``"a.b: old -> new"`` for each leaf where two builtins trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new), key=str)
                for line in _differences(old.get(key), new.get(key), ignore=ignore, prefix=f"{prefix}{key}.")]
    path = prefix.removesuffix(".")
    return [] if old == new or path in ignore else [f"{path}: {old!r} -> {new!r}"]


# ---------------------------------------------------------------------------------------------------------- run folder


def run_metadata(launch: Launch, world: int) -> dict[str, Any]:
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


def launches(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The launches of a run folder, oldest first (run.json's ``launches``: each launch's record, its ``start_step``
    and the ``config`` it ran with)."""
    meta = _read_json(pathlib.Path(run_dir) / RUN_FILE)
    return list(meta.get("launches", [meta] if meta else []))


def launch_at(run_dir: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """The launch that ran step ``step`` (the last whose ``start_step`` is at most ``step``; None: the last)."""
    history = launches(run_dir)
    if step is not None:
        history = [entry for entry in history if entry.get("start_step", 0) <= step] or history[:1]
    return history[-1] if history else {}


def load_run(run_dir: str | os.PathLike, step: int | None = None, experiment: str | None = None) -> Experiment:
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
    if not isinstance(loaded.config, Experiment):
        raise fconfig.ConfigError(f"{str(run_dir)!r} holds a {type(loaded.config).__qualname__}, not an "
                                  "fvx.loop.Experiment")
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


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as error:
        raise fconfig.ConfigError(f"{str(path)!r} is not valid JSON: {error}") from None


def _write_json(path: pathlib.Path, record: Any) -> None:
    """``record`` as JSON at ``path``, atomically (a run killed while writing keeps the previous file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())


# ---------------------------------------------------------------------------------------------------------- training


def train(config: Experiment, *, prepared: Prepared | None = None, launch: Launch = Launch(), rank: int = 0,
          world: int = 1) -> TrainState:
    """Run from the prepared state (step 0, or a restored checkpoint) to ``config.run.steps``; log to TensorBoard
    and save checkpoints on rank 0 (on every rank of a sharded run: each writes its shards); return the final
    state. Raises :class:`NonFiniteError` when a step's loss or gradients are not finite and ``run.on_nonfinite``
    is ``halt`` (or the method could not skip the update)."""
    out = pathlib.Path(config.run.output_dir)
    prepared = prepared if prepared is not None else prepare(config, rank=rank, world=world)
    start = int(prepared.state.step)
    meta = run_metadata(launch, world)
    record = fconfig.record(config)
    log_hparams = start == 0 or not (out / TENSORBOARD).is_dir()  # a run resumed in place logged them at step 0
    lock = run_lock.acquire(out) if rank == 0 else None  # before anything is written
    try:
        return _train(config, prepared, out, meta, record, start, log_hparams, rank, world)
    finally:
        if lock is not None:
            run_lock.release(lock)


def _train(config: Experiment, prepared: Prepared, out: pathlib.Path, meta: dict, record: dict, start: int,
           log_hparams: bool, rank: int, world: int) -> TrainState:
    """:func:`train` once the run folder's lock is held."""
    state = prepared.state
    if rank == 0:
        fconfig.dump(config, out)
        earlier = [entry for entry in launches(out) if entry.get("start_step", 0) < start]  # those it continues
        _write_json(out / RUN_FILE, {"launches": earlier + [{**meta, "start_step": start, "config": record}]})
        if (out / TENSORBOARD).is_dir():
            tracking.truncate_events(out / TENSORBOARD, start, report=lambda line: print(line, file=sys.stderr))
            tracking.wait_for_a_new_second(out / TENSORBOARD)
    saves = config.run.checkpoint
    checkpoints = (open_checkpoints(out / CHECKPOINTS, prepared.setup, saves)  # every rank: sharded saves
                   if (rank == 0 or world > 1) and (saves.every or saves.final) else None)

    def save(state: TrainState, skips: int) -> None:
        checkpoints.save(state, config=record, meta={**meta, "nonfinite_skips": skips})

    hooks, validator = prepared.callbacks, prepared.validator
    if validator is not None:
        hooks = fcallbacks.check(hooks + (validation.callback(validator, prepared.setup.program.validate, hooks),))

    try:
        wandb = config.run.wandb
        mirrors = (lambda: ()) if wandb is None else (lambda: (WandbMirror(wandb, out),))
        with tracking.open_tracker(out / TENSORBOARD, rank=rank, mirrors=mirrors) as tracker:
            if rank == 0 and log_hparams:
                tracker.hparams(msgspec.to_builtins(config))

            def context(state: TrainState, metrics: dict[str, float]) -> fcallbacks.Context:
                return fcallbacks.Context(int(state.step), state, prepared.frozen, metrics, tracker, out)

            fcallbacks.call(hooks, "on_train_start", context(state, {}))
            state = run_steps(config, prepared.setup, state, prepared.frozen, range(start, config.run.steps), tracker,
                              save=None if checkpoints is None else save,
                              check_saves=None if checkpoints is None else checkpoints.poll,
                              after_step=lambda state, metrics: fcallbacks.call(hooks, "on_step_end",
                                                                                context(state, metrics)),
                              nonfinite_skips=prepared.nonfinite_skips, rank=rank, world=world,
                              experiment=meta.get("experiment"))
            if config.run.steps > start:  # a finished run resumed logs no second summary
                log_run_summary(tracker, state, compile_stats(prepared.setup), config.run.steps - 1)
            fcallbacks.call(hooks, "on_train_end", context(state, {}))
    finally:
        if checkpoints is not None:
            checkpoints.close()  # waits for a pending async save
    return state


def make_validator(config: Experiment, built: Setup, out: pathlib.Path) -> validation.Validator | None:
    """The run's fixed validation prompts (in the data model's cond), noise and decoder, or None when validation is
    off."""
    if config.validation.every == 0:
        return None
    vae = config.build_vae()
    return validation.make_validator(config.validation, built.dataset, built.program.model,
                                     decode=None if vae is None else vae.decode, folder=out / "validation")


class CompiledGraphs(NamedTuple):
    graphs: int
    recompiles: int


def compile_stats(built: Setup) -> CompiledGraphs | None:
    """The compiled graphs of all the run's models together (each model built once), or None when none compiles."""
    stats = {id(m.compile_stats): m.compile_stats for m in built.models.values() if m.compile_stats is not None}
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


def run_steps(config: Experiment, built: Setup, state: TrainState, frozen: dict[str, Any], steps: range,
              tracker: tracking.Tracker, *,
              save: Callable[[TrainState, int], None] | None = None,
              check_saves: Callable[[], None] | None = None,
              after_step: Callable[[TrainState, dict[str, float]], None] | None = None, nonfinite_skips: int = 0,
              rank: int = 0, world: int = 1, experiment: str | None = None) -> TrainState:
    """Take ``steps`` with ``built.program.step_`` (the frozen roles' params ``frozen``) on prefetched batches,
    logging every ``config.run.log_every`` (and every non-finite step), calling ``save(state, skips)`` after each
    step a checkpoint is due (by step count or ``every_seconds``), then ``after_step(state, metrics)`` (the callbacks'
    ``on_step_end``); ``check_saves()`` after every step raises a failed background save. SIGTERM or SIGINT: the
    step in flight finishes, is saved, and :class:`Interrupted` stops the run (every rank alike); more than
    ``run.max_consecutive_skips`` skipped steps in a row halt it."""
    global_batch, run = config.data.batch_size, config.run
    progress = _progress_bar(config, steps, rank)
    consecutive, last_save = 0, time.monotonic()
    try:
        batch_at = batch_fn(config, built, rank=rank, world=world)
        with data.Prefetcher(batch_at, steps, depth=config.data.prefetch) as batches, Signals() as signals:
            for step, batch in batches:
                start = time.perf_counter()
                state, metrics = built.program.step_(state, frozen, batch)
                values = {name: float(value) for name, value in metrics.items()}  # waits for the step
                elapsed = time.perf_counter() - start
                flagged = values.pop(NONFINITE, 0.0) != 0.0
                nonfinite = flagged or not all(math.isfinite(v) for v in values.values())
                skip = nonfinite and flagged and run.on_nonfinite == "skip"
                nonfinite_skips += skip
                consecutive = consecutive + 1 if skip else 0
                if nonfinite or step % run.log_every == 0 or step == steps.stop - 1:
                    counted = {"nonfinite_skips": nonfinite_skips} if run.on_nonfinite == "skip" else {}
                    tracker.scalars(step, {**values, "step_time_s": elapsed, "samples_per_s": global_batch / elapsed,
                                           **counted})
                if (nonfinite and not skip) or consecutive > run.max_consecutive_skips:
                    tracker.flush()
                    raise _halt(config, step, values, applied=not flagged, rank=rank, consecutive=consecutive,
                                experiment=experiment)
                if check_saves is not None:
                    check_saves()
                timed = run.checkpoint.every_seconds is not None and \
                    time.monotonic() - last_save >= run.checkpoint.every_seconds
                stop = signals.received is not None
                if world > 1:  # every rank must save and stop at the same step
                    timed, stop = any_rank(timed), any_rank(stop)
                if save is not None and (checkpoint.due(run.checkpoint, step + 1, run.steps) or timed or stop):
                    save(state, nonfinite_skips)
                    last_save = time.monotonic()
                if stop:
                    raise Interrupted(step + 1, signals.received or signal.SIGTERM)
                if after_step is not None:
                    after_step(state, values)
                if progress is not None:
                    losses = {name: f"{value:.4g}" for name, value in values.items() if name.endswith("loss")}
                    progress.set_postfix(losses, refresh=False)
                    progress.update(1)
    finally:
        if progress is not None:
            progress.close()
    return state


def _halt(config: Experiment, step: int, values: dict[str, float], *, applied: bool, rank: int,
          consecutive: int = 0, experiment: str | None = None) -> NonFiniteError:
    """Record the non-finite step in the run folder and make the error that stops the run."""
    out = config.run.output_dir
    command = f"python -m fvx.run replay {shlex.quote(out)} --step {step}"
    own = fconfig.foreign_classes(config)
    if own and experiment is not None:  # their code (not only their values) decides the step
        command += f" --experiment {shlex.quote(experiment)}"
    shown = ", ".join(f"{name}={value:.6g}" for name, value in values.items())
    if consecutive > config.run.max_consecutive_skips:
        why = (f"{consecutive} steps in a row were skipped, more than run.max_consecutive_skips="
               f"{config.run.max_consecutive_skips}")
    elif applied:
        why = ("the method applied the update anyway (it reports no 'nonfinite' flag; see fvx.state.skipped), so "
               "the state is spoiled and the step cannot be skipped")
    else:
        why = f"run.on_nonfinite={config.run.on_nonfinite}"
    if rank == 0:
        _write_json(pathlib.Path(out) / NONFINITE_FILE,
                    {"step": step, "metrics": values, "update_applied": applied, "replay": command})
    return NonFiniteError(f"step {step}: non-finite loss or gradient ({shown}); the run halted ({why}). "
                          f"Replay the step with: {command}", step, command)


def _progress_bar(config: Experiment, steps: range, rank: int):
    if rank != 0 or not config.run.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=steps.stop, initial=steps.start, desc="train", unit="step", dynamic_ncols=True)
