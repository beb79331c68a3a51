"""An experiment and what a run builds from it before its first step.

An experiment's root config subclasses :class:`Experiment` and adds ``models`` (model name -> a model config, whose
``build(mesh=)`` gives the model interface) and a ``method`` whose ``roles`` (a Struct: role -> model name) say which
model plays each role, and whose ``build(models, total_steps=..., ranks=...)`` (``models``: role -> built model;
``ranks``: the processes its numbers combine over, ``fvx.core.role.Ranks``; and, by name, the experiment's fields the
method's ``needs`` lists: ``vae`` for a method that encodes or decodes frames, ``data`` for one that reads its own
batches) gives an ``fvx.core.state.Program``. Each named model is built once, whatever the number of roles it
plays. :func:`prepare` builds it all, checks the first batch and restores a checkpoint when asked
(``fvx.training.resume``), writing nothing: what the loop (``fvx.training.loop``) then runs.

What can be refused from the config and the models' skeletons alone, before any file is read, is
``fvx.training.config_checks``: the run (:func:`prepare`) and ``--dry-run`` both call it.

Keys. ``(method_key, data_key) = split(key(run.seed))``: the method's (its state, frozen roles and steps) and the
data's (sample order, synthetic samples, CFG dropout); nothing else about randomness exists, so a checkpoint holds
only the state.
"""
from __future__ import annotations

import contextlib
import math
import pathlib
from typing import Annotated, Any, Callable, Literal, Mapping, NamedTuple, Sequence

import msgspec
import torch

from fvx import config as fconfig
from fvx.config import Config, ConfigError
from fvx.core import random, role
from fvx.core.state import Program, TrainState
from fvx.data import batching, datasets, parquet
from fvx.distributed import processes, sequence_parallel
from fvx.storage.checkpoint_config import CheckpointConfig
from fvx.training import callbacks as fcallbacks, config_checks, resume, run_folder, run_lock, validation
from fvx.training.wandb_mirror import check_available, WandbConfig


class RunConfig(Config):
    """Where a run writes, how long it runs, its seed (every key of the run derives from it), how it checkpoints,
    what a non-finite loss or gradient does (``halt`` the run, or ``skip`` the update: the step still counts; more
    than ``max_consecutive_skips`` skips in a row halt it), and
    whether Weights & Biases mirrors the TensorBoard logs (``wandb``; None: TensorBoard only)."""

    seed: int = 0
    steps: Annotated[int, msgspec.Meta(ge=1)] = 100
    output_dir: str = "runs/default"
    log_every: Annotated[int, msgspec.Meta(ge=1)] = 1
    progress: bool = True
    on_nonfinite: Literal["halt", "skip"] = "halt"
    max_consecutive_skips: Annotated[int, msgspec.Meta(ge=1)] = 20
    checkpoint: CheckpointConfig = CheckpointConfig()
    wandb: WandbConfig | None = None


class Experiment(Config):
    """The root of an experiment config; subclasses add ``models`` and ``method`` (module docstring), and may override
    :meth:`callbacks` to add lifecycle hooks (``fvx.training.callbacks``). A field ``vae`` (a config with
    ``build(key)``)
    decodes validation samples into videos; without one, validation logs latent previews. A field ``audio_vae`` decodes
    a joint model's audio into waveforms (a ``.wav`` beside each GIF)."""

    run: RunConfig = RunConfig()
    data: datasets.DataConfig = datasets.DataConfig()
    validation: validation.ValidationConfig = validation.ValidationConfig()

    def build_vae(self) -> Any:
        """The decoder of validation samples: the experiment's ``vae`` config built from the validation seed (an
        object with ``decode(latents) -> video``), or None without one."""
        vae = getattr(self, "vae", None)
        return None if vae is None else vae.build(random.key(self.validation.seed))

    def build_audio_vae(self) -> Any:
        """The audio decoder of a joint model's validation samples: the experiment's ``audio_vae`` config built (an
        object with ``decode(latents) -> waveforms [N, C, S]`` in [-1, 1] and ``sample_rate``), or None."""
        vae = getattr(self, "audio_vae", None)
        return None if vae is None else vae.build(random.key(self.validation.seed))

    def callbacks(self) -> tuple[fcallbacks.Callback, ...]:
        """The run's callbacks besides validation (which the loop adds), run in order."""
        return ()


class Setup(msgspec.Struct, frozen=True):
    """Everything a run builds from its config before the first step: the models by role, the method's program, the
    dataset, and the keys."""

    models: dict[str, Any]
    program: Program
    dataset: Any
    data_key: torch.Tensor
    method_key: torch.Tensor
    mesh: Any = None  # the device mesh of a multi-process run (fvx.distributed.processes.make_mesh), else None


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


def load_config(experiment_file: str, overrides: Sequence[str]) -> Experiment:
    """An experiment file's config (``FILE.py`` or ``FILE.py:recipe``) with dotted overrides applied; a ConfigError
    naming the culprit (an argument that is no override, a ``config`` that is no :class:`Experiment`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"argument {item!r} is not an override of the form dotted.field=value")
    config = fconfig.load_experiment(experiment_file)
    if not isinstance(config, Experiment):
        raise ConfigError(f"experiment file {experiment_file!r}: `config` is a {type(config).__qualname__}, "
                          "expected a subclass of fvx.training.experiment.Experiment")
    return fconfig.apply_overrides(config, list(overrides))


def run_keys(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(method_key, data_key) = split(key(seed))`` (module docstring)."""
    method_key, data_key = random.split(random.key(seed))
    return method_key, data_key


def role_configs(config: Experiment) -> dict[str, Any]:
    """Role -> the model config that plays it (``config.method.roles`` names models of ``config.models``); a
    ConfigError names a role whose model the experiment does not define."""
    roles = msgspec.structs.asdict(config.method.roles)
    for name, model in roles.items():
        if model not in config.models:
            raise ConfigError(f"method.roles.{name} names model {model!r}, which the experiment does not define "
                              f"(models: {', '.join(config.models) or 'none'})")
    return {name: config.models[model] for name, model in roles.items()}


def build_models(config: Experiment, *, mesh: Any = None) -> dict[str, Any]:
    """Role -> built model: each named model of ``config.models`` that plays a role is built once (on ``mesh``).
    Every role but the one the data feeds (the method's first held role: the student) sees its model's dense view
    (``Model.dense``: a VSA model at sparsity 0, as FastVideo's critic and teacher see theirs)."""
    roles = msgspec.structs.asdict(config.method.roles)
    role_configs(config)  # every role names a model
    held = config.method.held_roles()
    first = held[0].name
    check_attention_roles(config, roles, first, trained={role.name for role in held if role.trainable})
    check_joint_roles(config, roles)
    on_mesh = {} if mesh is None else {"mesh": mesh}
    built = {name: config.models[name].build(**on_mesh) for name in dict.fromkeys(roles.values())}
    return {role_name: built[name] if role_name == first else built[name].dense() for role_name, name in roles.items()}


def check_attention_roles(config: Experiment, roles: Mapping[str, str], first: str, trained: set[str]) -> None:
    """A ConfigError when a quantization-aware model (fake-quantized attention, ``attention=qat``, or NVFP4 linear
    layers, ``linear_qat``) plays a role other than the student (``first``): quantization is the student's alone
    (FastVideo's critic and teacher keep full precision, and roles that share a model share its code); or when a
    trained role's model runs flex-attention where it has no backward (no CUDA device)."""
    for role_name, name in roles.items():
        if role_name in trained and getattr(config.models[name], "attention", "sdpa") == "flex" \
                and not torch.cuda.is_available():
            raise ConfigError(f"models.{name}.attention=flex: flex-attention has no backward on a CPU (torch "
                              f"{torch.__version__.split('+')[0]}) and role {role_name!r} trains; use attention=math "
                              "or sdpa")
    for role_name, name in roles.items():
        knob = quantized(config.models[name])
        if role_name != first and knob is not None:
            shared = f" as well as the {first}" if roles.get(first) == name else ""
            raise ConfigError(f"models.{name}.{knob}: model {name!r} plays method.roles.{role_name}{shared}, which "
                              f"must stay full precision (quantization-aware training is the {first}'s); play it "
                              f"with a model entry of its own without {knob} (models.<name> and "
                              f"method.roles.{role_name}=<name>)")


def quantized(model: Any) -> str | None:
    """The knob that makes ``model`` quantization-aware (``attention=qat`` or ``linear_qat``), or None."""
    if getattr(model, "attention", "sdpa") == "qat":
        return "attention=qat"
    return "linear_qat" if getattr(model, "linear_qat", None) is not None else None


def check_joint_roles(config: Experiment, roles: Mapping[str, str]) -> None:
    """A ConfigError when a model that denoises several modalities together (a joint model: video and audio) plays a
    role of a method that trains one-modality models only (its config class lacks ``joint_models = True``)."""
    if getattr(type(config.method), "joint_models", False):
        return
    for role_name, name in roles.items():
        model = config.models[name]
        modalities = model.family.trained(model)
        if len(modalities) > 1:
            method = type(config.method).__struct_config__.tag or type(config.method).__name__
            raise ConfigError(f"models.{name} ({model.family.name}) denoises {' and '.join(modalities)} together, "
                              f"but method {method} trains one-modality models only (role {role_name}); train it "
                              "with a method that supports joint models")


def in_attention_steps(step_: Callable, models: Mapping[str, Any], student: str) -> Callable:
    """``step_`` run within every model's ``attention_step(state.step)`` (each model once): VSA's scheduled
    sparsity and QAT's training form hold in training steps only, and replay recomputes them from the step. The
    ``student`` role's sparsity, when its model runs VSA, is logged as ``vsa_sparsity`` (FastVideo's name)."""
    entered = list(dict.fromkeys(model.kernels.attention_step for model in models.values()))
    logged = models[student].kernels.attention_step

    def step(state: TrainState, frozen: Any, batch: Any):
        with contextlib.ExitStack() as stack:
            sparsity = {enter: stack.enter_context(enter(int(state.step))) for enter in entered}
            state, metrics = step_(state, frozen, batch)
        if sparsity[logged] is not None:
            metrics = {**metrics, "vsa_sparsity": torch.tensor(sparsity[logged])}
        return state, metrics
    return step


def setup(config: Experiment, *, mesh: Any = None, callbacks: tuple[fcallbacks.Callback, ...] = (),
          models: dict[str, Any] | None = None) -> Setup:
    """Build the models (unless given: :func:`build_models`' on the same ``mesh``), the method's program (its
    ``before_update`` running the callbacks' ``on_before_optimizer_step``; on a device mesh its numbers combine over
    the mesh's ranks) and the dataset (the experiment's, as the program's ``dataset`` makes it the data its steps
    read); keys are :func:`run_keys`."""
    method_key, data_key = run_keys(config.run.seed)
    models = build_models(config, mesh=mesh) if models is None else models
    ranks = role.ONE_PROCESS if mesh is None else processes.group_of(mesh)
    needed = {name: getattr(config, name, None) for name in getattr(config.method, "needs", ())}
    program = config.method.build(models, total_steps=config.run.steps, ranks=ranks,
                                  before_update=fcallbacks.before_update(callbacks), **needed)
    program = program._replace(step_=in_attention_steps(program.step_, models, config.method.held_roles()[0].name))
    dataset = program.dataset(datasets.open_dataset(config.data, data_key))
    return Setup(models=models, program=program, dataset=dataset, data_key=data_key, method_key=method_key,
                 mesh=mesh)


def batch_fn(config: Experiment, built: Setup, *, rank: int = 0, world: int = 1) -> Callable[[int], Any]:
    """``step -> this rank's batch`` as methods see it (the data model's ``cond`` made from the data, read as the
    program's ``batch_at`` says): a pure function of the config's seed. Under sequence parallelism the slice is the
    data-parallel rank's (``rank // sp`` of ``world // sp``): the ranks of an SP group read the same samples."""
    rank, world = processes.data_rank(built.mesh, rank, world)
    read = built.program.batch_at or batching.batch_at

    def at(step: int):
        try:
            raw = read(built.dataset, built.data_key, step, batch_size=config.data.batch_size, rank=rank, world=world)
        except parquet.DataError as error:
            raise parquet.DataError(f"step {step}: {error}") from None
        return built.program.model.batch(raw)
    return at


def check_sequence_parallel(built: Setup, batch: Any) -> None:
    """Under sequence parallelism, a ValueError saying what to change unless the batch's latents ``[B, C, T, H, W]``
    make a token count (after the model's patching) that the SP group splits evenly."""
    sequence, latents = processes.sequence_group(built.mesh), batch.get("latents") if isinstance(batch, dict) else None
    if sequence is None or not isinstance(latents, torch.Tensor) or latents.dim() != 5:
        return
    patch = built.program.model.patch_size
    tokens = math.prod(size // p for size, p in zip(latents.shape[2:], patch))
    try:
        sequence_parallel.local_tokens(tokens, sequence)
    except ValueError as error:
        raise ValueError(f"latents {tuple(latents.shape)} (patch {tuple(patch)}): {error}") from None


def initial_state(built: Setup, batch: Any) -> TrainState:
    """The state a run starts from: a pure function of the config and seed, with the method's carried state made for
    ``batch``'s shapes (the first batch); also the target a checkpoint restores into."""
    return built.program.init(built.method_key)._replace(carry=built.program.carry(batch))


def frozen_params(built: Setup) -> dict[str, Any]:
    """The frozen roles' params (a teacher, loaded or drawn from the run's keys): made once per run, never saved."""
    return built.program.frozen(built.method_key)


def make_validator(config: Experiment, built: Setup, out: pathlib.Path) -> validation.Validator | None:
    """The run's fixed validation prompts (in the data model's cond), noise and decoder, or None when validation is
    off."""
    if config.validation.every == 0:
        return None
    vae = config.build_vae()
    return validation.make_validator(config.validation, built.dataset, built.program.model,
                                     decode=None if vae is None else vae.decode, audio=config.build_audio_vae(),
                                     folder=out / "validation")


def prepare(config: Experiment, *, resume_from: str | int | None = None, rank: int = 0, world: int = 1,
            mesh: Any = None) -> Prepared:
    """Build everything (on ``mesh`` when given), check the first batch against the method, load the frozen roles
    and restore the checkpoint ``resume_from`` names (``fvx.training.resume.find_checkpoint``), writing nothing: bad
    input and unusable checkpoints fail here."""
    out = pathlib.Path(config.run.output_dir)
    run_folder.check_writable(out)
    run_lock.check(out)
    run_folder.launches(out)  # a damaged run.json is refused now, not after the run folder is written
    if config.run.wandb is not None and rank == 0:
        check_available()
    callbacks = fcallbacks.check(config.callbacks())
    models = build_models(config, mesh=mesh)
    config_checks.check_models(config, models)  # what --dry-run refuses too
    built = setup(config, mesh=mesh, callbacks=callbacks, models=models)
    first = batch_fn(config, built, rank=rank, world=world)(0)
    built.program.check(first)
    check_sequence_parallel(built, first)
    config_checks.check_folders(config)  # after the roles' and the data's checks, before any weights load
    validator = make_validator(config, built, out)
    state = initial_state(built, first)
    if resume_from is None:
        resume.check_no_checkpoints(out / run_folder.CHECKPOINTS)
        return Prepared(built, state, frozen_params(built), callbacks=callbacks, validator=validator)
    restored = resume.restore(config, state, resume_from, mesh=mesh, move_damaged=rank == 0)
    return Prepared(built, restored.state, frozen_params(built), nonfinite_skips=restored.nonfinite_skips,
                    resumed_from=restored.folder, config_changes=restored.changes, callbacks=callbacks,
                    validator=validator)
