"""The refusals and warnings of an experiment's config that need only the config and the roles' models (meta
skeletons: no weight and no file read). The run (``fvx.training.experiment.prepare``) and ``--dry-run``
(``fvx.training.dry_run``) both call :func:`check_models`, so the dry run refuses what the run refuses, with the same
line. A method takes part through two optional hooks, which its own ``build`` and batch check call too:
``check_models(models)`` (its refusals of the roles' models: a student that is not block-causal, a second time input
missing, a derivative mode the model cannot run) and ``check_latent_frames(models, frames)`` (its refusal of samples
of ``frames`` latent frames: clips that are not whole blocks). :func:`check_folders` runs before any weights load;
:func:`config_warnings` are the contradictions that are legal (one line each, printed by ``fvx.run``).
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import msgspec

from fvx.config import ConfigError
from fvx.core.optim_config import AdamWConfig
from fvx.data.parquet import FIRST_FRAME_KINDS
from fvx.training import run_folder


def check_skippable(config: Any) -> None:
    """A ConfigError when ``run.on_nonfinite=skip`` cannot skip a step: the method applies several optimizer updates
    in one (its ``updates_per_step(data)``), and those before a non-finite one are already applied."""
    updates = getattr(config.method, "updates_per_step", None)
    count = 1 if updates is None else updates(config.data)
    if config.run.on_nonfinite == "skip" and count > 1:
        raise ConfigError(f"run.on_nonfinite=skip cannot skip a step of {type(config.method).__name__}: it applies "
                          f"{count} optimizer updates per step and those before a non-finite one stay applied; use "
                          "run.on_nonfinite=halt, or method settings that make one update per step")


def check_cfg_dropout(config: Any, models: Mapping[str, Any]) -> None:
    """A ConfigError when the data drops text for classifier-free guidance (``data.cfg_rate``) but a model refuses to
    train on such data (``Model.rules.cfg_dropout_refusal``, a family's rule); ``models`` by role, named by the model
    that plays it."""
    played = msgspec.structs.asdict(config.method.roles)
    for role_name, model in models.items():
        refusal = model.rules.cfg_dropout_refusal
        if config.data.cfg_rate > 0 and refusal is not None:
            raise ConfigError(f"data.cfg_rate = {config.data.cfg_rate}: models.{played.get(role_name, role_name)} "
                              f"({model.name}) takes no CFG dropout ({refusal}); set data.cfg_rate=0")


def check_folders(config: Any) -> None:
    """A ConfigError naming the field of a model's (or the VAE's) ``path`` that does not exist, before any weights
    load: such a folder is often the export of an earlier run of this repository's scenarios; or that is a run folder
    (or its checkpoints), which holds fvx's state, not a diffusers folder: the line gives the export command."""
    fields = {f"models.{name}.path": getattr(model, "path", None) for name, model in config.models.items()}
    fields["vae.path"] = getattr(getattr(config, "vae", None), "path", None)
    for field, path in fields.items():
        if path is not None and not pathlib.Path(path).exists():
            raise ConfigError(f"{field} = {path!r} does not exist; when it is an earlier run's export, the experiment "
                              "file's docstring gives the commands that make it")
        run = None if path is None else run_folder_of(pathlib.Path(path))
        if run is not None:
            folder, step = run
            raise ConfigError(f"{field} = {path!r} is an fvx run folder, not a diffusers folder; export it first: "
                              f"python -m fvx.run export {folder}{'' if step is None else f' --step {step}'} "
                              f"--out FOLDER, then set {field}=FOLDER")


def run_folder_of(path: pathlib.Path) -> tuple[pathlib.Path, str | None] | None:
    """``(run folder, checkpoint step or None)`` when ``path`` is a run folder (it holds ``run.json`` or
    ``checkpoints/``: fvx.training.run_folder), its ``checkpoints/`` folder or one checkpoint in it; else None."""
    def is_run(folder: pathlib.Path) -> bool:
        return (folder / run_folder.RUN_FILE).is_file() or (folder / run_folder.CHECKPOINTS).is_dir()

    if is_run(path):
        return path, None
    if path.name == run_folder.CHECKPOINTS and is_run(path.parent):
        return path.parent, None
    if path.parent.name == run_folder.CHECKPOINTS and is_run(path.parent.parent):
        return path.parent.parent, path.name
    return None


def check_models(config: Any, models: Mapping[str, Any]) -> None:
    """The refusals that need only the config and the roles' models (``build_models``: skeletons, no weight and no
    file read), each a one-line ValueError: what ``run.on_nonfinite=skip`` cannot skip, a model no role plays, CFG
    dropout a model refuses, a text-to-video model on image-to-video data, then the method's own (its optional
    ``check_models(models)``: the module docstring). The run (:func:`prepare`) and ``--dry-run`` both call it."""
    check_skippable(config)
    check_all_models_play(config)
    check_cfg_dropout(config, models)
    check_image_input(config, models)
    check_action_input(config, models)
    check_kind_inputs(config, models)
    check_own_schedule(config, models)
    method_check = getattr(config.method, "check_models", None)
    if method_check is not None:
        method_check(models)


def check_all_models_play(config: Any) -> None:
    """A ConfigError naming each ``models.<name>`` that no ``method.roles.*`` names: it would be neither built nor
    trained, which a typo in a role (or a forgotten one) makes silently."""
    roles = msgspec.structs.asdict(config.method.roles)
    unused = [name for name in config.models if name not in roles.values()]
    if unused:
        played = ", ".join(f"{role}={model}" for role, model in roles.items())
        raise ConfigError(f"{', '.join(f'models.{name}' for name in unused)}: no role plays "
                          f"{'it' if len(unused) == 1 else 'them'} (method.roles: {played}); name it in a role "
                          "(method.roles.<role>=<name>) or leave it out of models")


IMAGE_INPUT = "first_frame_latents"  # the tensor data.kind=i2v (i2va) adds (fvx.data.datasets): the first frame


def check_image_input(config: Any, models: Mapping[str, Any]) -> None:
    """A ConfigError when the data gives each clip's first frame (``data.kind=i2v`` or ``i2va``) but the model the
    data feeds (the method's first held role) takes no image input: it would train text-to-video on the clips, the
    frame unread. The line names the knob (``first_frame``) or the family's presets that take one."""
    kind = config.data.kind
    if kind not in ("i2v", "i2va"):
        return
    role_name = config.method.held_roles()[0].name
    model = models[role_name]
    if IMAGE_INPUT in model.cond:
        return
    name = msgspec.structs.asdict(config.method.roles)[role_name]
    model_config = config.models[name]
    family = model_config.family
    presets = [preset for preset in family.presets if IMAGE_INPUT in spec_with(model_config, preset=preset)]
    fix = (f"use an image-to-video preset, models.{name}.preset=PRESET with PRESET one of {', '.join(presets)}"
           if presets else
           f"the {family.name} family has no image-to-video preset: use data.kind="
           f"{'t2va' if kind == 'i2va' else 't2v'}, or a family that has one")
    if "first_frame" in model_config.__struct_fields__ and IMAGE_INPUT in spec_with(model_config, first_frame=True):
        fix = f"set models.{name}.first_frame=true (its image-to-video)"
    raise ConfigError(f"data.kind={kind} gives each clip's first frame, but models.{name}.preset={model_config.preset} "
                      f"({model.name}) takes no image input (it would train text-to-video, the frame unread); {fix}")


ACTION_INPUT, ACTION_KIND = "keyboard", "matrixgame2"  # the tensor data.kind=matrixgame2 adds: actions per frame


def check_action_input(config: Any, models: Mapping[str, Any]) -> None:
    """A ConfigError when actions and models disagree: data of actions per frame (``data.kind=matrixgame2``) for a
    model without action modules (the actions unread), or a model that reads actions, or the first frame, from data
    that gives none."""
    kind = config.data.kind
    for name, model in models.items():
        reads_actions, reads_image = ACTION_INPUT in model.cond, IMAGE_INPUT in model.cond
        if kind == ACTION_KIND and not reads_actions:
            raise ConfigError(f"data.kind={ACTION_KIND} gives actions per video frame, but models.{name} "
                              f"({model.name}) has no action modules to read them; use a model whose cond "
                              f"reads them ({ACTION_INPUT!r})")
        if reads_actions and kind != ACTION_KIND:
            raise ConfigError(f"models.{name} ({model.name}) reads actions and the first frame of each clip, which "
                              f"data.kind={kind} does not give; use data.kind={ACTION_KIND}")
        if reads_image and kind not in FIRST_FRAME_KINDS:
            raise ConfigError(f"models.{name} ({model.name}) is image-to-video: it needs each clip's first frame, "
                              f"which data.kind={kind} does not give; use data.kind="
                              f"{'i2va' if kind == 't2va' else 'i2v'}")


KIND_INPUTS = {"vace": ("vace_context", "a control context per clip"),
               "animate": ("pose_latents", "a reference image and pose and face videos per segment")}
"""The data kinds that give a family's own inputs: kind -> (the tensor a model reads them by, what they are)."""


def check_kind_inputs(config: Any, models: Mapping[str, Any]) -> None:
    """A ConfigError when a kind's own inputs (:data:`KIND_INPUTS`: VACE's control context, Wan-Animate's pose) and
    the models disagree: such data for a model that reads none (it would train without them), or a model that reads
    them from data that gives none."""
    kind = config.data.kind
    for name, model in models.items():
        for own_kind, (tensor, what) in KIND_INPUTS.items():
            reads = tensor in model.cond
            if kind == own_kind and not reads:
                raise ConfigError(f"data.kind={own_kind} gives {what}, but models.{name} ({model.name}) reads none "
                                  f"(it would train without them); use a model whose cond reads them ({tensor!r})")
            if reads and kind != own_kind:
                raise ConfigError(f"models.{name} ({model.name}) reads {what}, which data.kind={kind} does not give; "
                                  f"use data.kind={own_kind}")


def check_own_schedule(config: Any, models: Mapping[str, Any]) -> None:
    """A ConfigError when validation samples on the model's own levels (``validation.schedule=model``) but a model
    the method samples has none (only a family with its own pipeline schedule has: CogVideoX's DDIM)."""
    validation = getattr(config, "validation", None)
    if validation is None or validation.schedule != "model":
        return
    lacking = [name for name, model in models.items() if model.rules.sampling_sigmas is None]
    if lacking:
        raise ConfigError(f"validation.schedule=model samples on a model's own levels, but models.{lacking[0]} "
                          f"({models[lacking[0]].name}) has none; use validation.schedule=fvx or diffusers")


def spec_with(model_config: Any, **changes: Any) -> Mapping[str, Any]:
    """The cond spec of ``model_config`` with ``changes`` (another preset, a knob on; {} when its other knobs do not
    fit them)."""
    try:
        return model_config.family.conditioning.spec(msgspec.structs.replace(model_config, **changes))
    except ValueError:
        return {}


def config_warnings(config: Any) -> list[str]:
    """The contradictions a run may mean (printed as warnings, one line each, by the run and ``--dry-run``): each
    optimizer of the method (``AdamWConfig`` fields) whose warmup does not end within the run's optimizer updates
    (``run.steps`` times the method's ``updates_per_step``). Legal, as the schedule allows: a run launched short and
    resumed with a larger ``run.steps`` finishes its warmup then (the warmup's ramp does not depend on the length)."""
    updates = getattr(config.method, "updates_per_step", None)
    span = config.run.steps * (1 if updates is None else updates(config.data))
    optimizers = [(name, getattr(config.method, name)) for name in config.method.__struct_fields__
                  if isinstance(getattr(config.method, name), AdamWConfig)]
    return [line for name, optim in optimizers if (line := optim.warmup_warning(f"method.{name}", span))]
