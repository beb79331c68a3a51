"""Export a trained role of a run: ``export(run_dir, out, step=None, role=None, ema=False, base=None, adapters=False,
form=None, dtype=None)``.

Whole weights (a LoRA role's adapters merged into its base in fp32, an expert left frozen as loaded): ``diffusers``,
what the role's model family writes (``Model.export.folder``): its pipeline components (``transformer/``; ``transformer/``
and ``transformer_2/`` for two experts: config.json + safetensors, loadable by the component class's
``from_pretrained``) and pipeline files (``model_index.json``, ``scheduler/``); or ``comfyui``, one file per component
in the family's original layout. With ``adapters``, a LoRA role's adapters alone (``peft``, ``comfyui``, ``musubi``).
The ComfyUI and musubi-tuner files are named after the run (:func:`file_stem`: ``<run>.safetensors``,
``<run>_lora_comfyui.safetensors``, ``<run>_lora_musubi.safetensors``; Wan 2.2 A14B's experts ``..._high_noise`` and
``..._low_noise``); the diffusers folder and the PEFT file keep diffusers' names.
Beside them ``fvx_export.json``: run folder, step, role, EMA or not, format, dtype, and how the method samples the
role (e.g. a distilled student's few-step timesteps). fvx trains transformers only: with ``base`` (a diffusers pipeline
folder of the same model) the other components (VAE, text encoders, tokenizers) are linked from it, so
``DiffusionPipeline.from_pretrained(out)`` loads a whole pipeline; without, the folder loads with those components
passed as ``None``. Files are written beside ``out`` and renamed into place, so an error leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable, NamedTuple

import msgspec

from fvx.core import role as fvx_role
from fvx.storage import checkpoint
from fvx.training import run_folder
from fvx.training.experiment import build_models, role_configs, run_keys

MANIFEST = "fvx_export.json"
DTYPES = ("fp32", "bf16")


class Exported(NamedTuple):
    """Where an export went and what it holds."""

    folder: pathlib.Path
    step: int
    role: str
    ema: bool
    files: dict[str, pathlib.Path]  # pipeline component -> what was written for it (a folder, or a file)
    how_to_load: tuple[str, ...]  # what a person runs to load the files (adapters, the original layout)
    dtypes: tuple[str, ...]  # the dtypes the tensors are stored in
    merged: bool  # a LoRA role's adapters merged into its base
    sampling: dict | None = None  # how the method samples the role (``method.sampling(role)``), when it says


class RoleCheckpoint(NamedTuple):
    """A trained role in a run's checkpoint: the run's config, the step, the role, its built model, and ``read()``,
    which loads its trained params (its EMA params when asked)."""

    config: Any
    step: int
    role: str
    model: Any
    read: Callable[[], Any]


def role_checkpoint(run_dir: str | os.PathLike, *, step: int | None = None, role: str | None = None,
                    ema: bool = False, who: str = "export") -> RoleCheckpoint:
    """Role ``role`` (default: the run's only trained role, or ``student``) of checkpoint ``step`` (default: the
    newest) of the run in ``run_dir``; a ValueError (or CheckpointError) naming what is missing, read before any
    weight is: no checkpoint, no such step or role, no EMA."""
    run_dir = pathlib.Path(run_dir)
    config = run_folder.load_run(run_dir)
    with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
        steps = checkpoints.steps()
        if not steps:
            raise checkpoint.CheckpointError(f"{who}: the run in {str(run_dir)!r} has no checkpoint")
        step = steps[-1] if step is None else step
        layout = checkpoints.layout(step)  # a CheckpointError lists the steps when there is no such one
    role = _choose_role(layout, role, run_dir, who)
    if ema and _has_no_tensors(layout["roles"][role].get("ema")):
        raise ValueError(f"{who} --ema: role {role!r} of the run in {str(run_dir)!r} keeps no EMA params")

    def read() -> Any:
        with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
            return checkpoints.read(step, ("roles", role, "ema" if ema else "params"))

    return RoleCheckpoint(config, step, role, role_configs(config)[role].build(), read)


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, role: str | None = None,
           ema: bool = False, base: str | os.PathLike | None = None, adapters: bool = False, form: str | None = None,
           dtype: str | None = None) -> Exported:
    """Write role ``role``'s params (its EMA params with ``ema``) of checkpoint ``step`` (default: the newest) of the
    run in ``run_dir`` to ``out``: whole weights as a diffusers folder (``form="diffusers"``, with the other
    components of the pipeline folder ``base`` linked beside them) or in the family's original layout
    (``"comfyui"``), a LoRA role's adapters merged into its base at full precision (``W + (alpha / r) B A`` in fp32),
    each param in ``dtype`` or by default as ``Model.export.folder`` says; or with ``adapters`` a LoRA role's adapters alone
    (``form`` ``"peft"``, ``"comfyui"`` or ``"musubi"``; ``Model.export.adapters``). ``role`` defaults to the run's
    only trained role, or to ``student`` (a distillation's). Bad input is a ValueError before anything is written."""
    run_dir, out = pathlib.Path(run_dir), pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export: {str(out)!r} already exists and is not an empty folder")
    form = form or ("peft" if adapters else "diffusers")
    saved = role_checkpoint(run_dir, step=step, role=role, ema=ema, who="export")
    config, step, role, model = saved.config, saved.step, saved.role, saved.model
    _check_request(model, role, adapters, form, dtype, base)
    base_index = None if base is None else _pipeline_index(pathlib.Path(base))
    trained = saved.read()
    sampling_of = getattr(config.method, "sampling", None)
    sampling = None if sampling_of is None else sampling_of(role)
    stem = file_stem(run_dir, ema)
    if adapters:
        written = model.export.adapters(trained, str(out), form, stem=stem)
    else:
        written = model.export.folder(role_params(config, role, model, trained), str(out), form=form, dtype=dtype,
                                      stem=stem)
    manifest = {"run": str(run_dir.absolute()), "step": step, "role": role, "ema": ema, "sampling": sampling,
                "base": None if base is None else str(pathlib.Path(base).absolute()), "adapters": adapters,
                "format": form, "dtype": dtype}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if base_index is not None:
        _link_base(pathlib.Path(base), base_index, out)
    merged = model.export.adapters is not None and not adapters
    return Exported(out, step, role, ema, written.files, written.how_to_load, written.dtypes, merged, sampling)


def file_stem(run_dir: pathlib.Path, ema: bool) -> str:
    """What the exported files are named after: the run folder's name (``runs/my_lora`` -> ``my_lora``), with
    ``_ema`` for its EMA params, so the files of two runs or of a run's two param sets can sit in one ComfyUI folder."""
    return run_dir.resolve().name + ("_ema" if ema else "")


def _check_request(model: Any, role: str, adapters: bool, form: str, dtype: str | None, base: Any) -> None:
    """A ValueError for an export ``model`` cannot make as asked, before anything is written."""
    if adapters and model.export.adapters is None:
        raise ValueError(f"export --lora: role {role!r} trains no adapters (its model config has no lora); export it "
                         "without --lora")
    formats = model.export.adapter_formats if adapters else model.export.formats
    if form not in formats:
        other = model.export.formats if adapters else model.export.adapter_formats
        if form in other:
            raise ValueError(f"export --format {form} is for " + ("whole weights: export without --lora" if adapters
                                                                  else "adapters: add --lora"))
        raise ValueError(f"export --format {form}: the {'adapters' if adapters else 'weights'} of role {role!r} export "
                         f"as {', '.join(formats[:-1])}{' or ' if len(formats) > 1 else ''}{formats[-1]}")
    if dtype is not None and (adapters or dtype not in DTYPES):
        raise ValueError("export --dtype is for whole weights (adapters are written in fp32)" if adapters
                         else f"export --dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if base is not None and (adapters or form != "diffusers"):
        raise ValueError("export --base links a pipeline's other components beside a diffusers folder; it does not "
                         f"apply to {'--lora' if adapters else '--format ' + form}")


def role_params(config: Any, role: str, model: Any, trained: Any) -> Any:
    """Role ``role``'s whole params for ``model``: ``trained`` (its params or EMA from a checkpoint) with the base it
    holds frozen (a LoRA base, an expert left frozen), made as the run made it but at full precision (fp32, however
    the run stored it: ``frozen_dtype``)."""
    if model.weights.base_id() is None:
        return trained
    config = full_precision(config)
    method_key, _ = run_keys(config.run.seed)
    program = config.method.build(build_models(config), total_steps=config.run.steps)  # no data needed
    return fvx_role.with_trained(program.frozen(method_key)[role], trained)


def full_precision(config: Any) -> Any:
    """``config`` with every model's frozen copy kept in fp32."""
    models = {name: msgspec.structs.replace(model, frozen_dtype="fp32") for name, model in config.models.items()}
    return msgspec.structs.replace(config, models=models)


def missing_components(folder: pathlib.Path) -> list[str]:
    """The components ``folder``'s model_index.json names that are not in it (a VAE, text encoders, tokenizers)."""
    index = json.loads((pathlib.Path(folder) / "model_index.json").read_text())
    return [name for name, entry in index.items()
            if not name.startswith("_") and isinstance(entry, list) and entry[0] is not None
            and not (pathlib.Path(folder) / name).exists()]


def _pipeline_index(base: pathlib.Path) -> dict:
    """``base``'s model_index.json, or a ValueError naming what is missing."""
    try:
        return json.loads((base / "model_index.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"export --base: {str(base)!r} is not a diffusers pipeline folder (no model_index.json)") \
            from None
    except json.JSONDecodeError as error:
        raise ValueError(f"export --base: {str(base / 'model_index.json')!r} is not valid JSON: {error}") from None


def _link_base(base: pathlib.Path, base_index: dict, out: pathlib.Path) -> None:
    """Link every component of ``base`` the export did not write into ``out`` and record them in its
    model_index.json (the export's own entries win)."""
    index = json.loads((out / "model_index.json").read_text())
    for name, entry in base_index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None or (out / name).exists():
            continue
        if not (base / name).is_dir():
            raise ValueError(f"export --base: {str(base)!r} lists component {name!r} but has no {name}/ folder")
        (out / name).symlink_to((base / name).absolute(), target_is_directory=True)
        index[name] = entry
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _choose_role(layout: dict, role: str | None, run_dir: pathlib.Path, who: str) -> str:
    trained = sorted(layout.get("roles") or {})
    if role is None and "student" in trained:
        return "student"
    if role is None:
        if len(trained) != 1:
            raise ValueError(f"{who}: the run in {str(run_dir)!r} trains roles {', '.join(trained)}; choose one with "
                             "--role")
        return trained[0]
    if role not in trained:
        raise ValueError(f"{who}: the run in {str(run_dir)!r} did not train role {role!r}; trained roles: "
                         f"{', '.join(trained) or 'none'}")
    return role


def _has_no_tensors(node) -> bool:
    return node is None or not checkpoint.leaves_by_name(node)
