"""Export a trained role of a run as a diffusers folder: ``export(run_dir, out, step=None, role=None, ema=False,
base=None)``.

The folder gets what the role's model family writes (``Model.export``): its pipeline components (``transformer/``;
``transformer/`` and ``transformer_2/`` for two experts: config.json + safetensors, loadable by the component class's
``from_pretrained``) and pipeline files (``model_index.json``, ``scheduler/``), plus ``fvx_export.json`` (run folder,
step, role, EMA or not, and how the method samples the role, e.g. a distilled student's few-step timesteps). fvx
trains transformers only: with ``base`` (a diffusers pipeline folder of the same model) the other components (VAE,
text encoders, tokenizers) are linked from it, so ``DiffusionPipeline.from_pretrained(out)`` loads a whole pipeline;
without, the folder loads with those components passed as ``None``. The family's folder is written beside ``out``
and renamed into place, so an error leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, NamedTuple

from fvx.core import role as fvx_role
from fvx.storage import checkpoint
from fvx.training import run_folder
from fvx.training.experiment import build_models, role_configs, run_keys

MANIFEST = "fvx_export.json"
LORA_FORMATS = ("peft", "comfyui", "merged")  # adapters for diffusers/PEFT, for ComfyUI, or merged into the weights


class Exported(NamedTuple):
    """Where an export went and what it holds."""

    folder: pathlib.Path
    step: int
    role: str
    ema: bool
    components: tuple[str, ...]  # the pipeline component folders written (transformer/, ...)
    sampling: dict | None = None  # how the method samples the role (``method.sampling(role)``), when it says


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, role: str | None = None,
           ema: bool = False, base: str | os.PathLike | None = None, lora: str | None = None) -> Exported:
    """Write role ``role``'s params (its EMA params with ``ema``) of checkpoint ``step`` (default: the newest) of the
    run in ``run_dir`` to the diffusers folder ``out``, with the other components of the pipeline folder ``base``
    linked beside them. ``role`` defaults to the run's only trained role, or to ``student`` (a distillation's). A
    LoRA role exports merged (``W + (alpha / r) B A``); ``lora="peft"`` or ``"comfyui"`` writes its adapters alone
    (``Model.export_adapters``), ``"merged"`` the merged folder."""
    run_dir, out = pathlib.Path(run_dir), pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export: {str(out)!r} already exists and is not an empty folder")
    if lora is not None and lora not in LORA_FORMATS:
        raise ValueError(f"export --format must be one of {', '.join(LORA_FORMATS)}; got {lora!r}")
    base_index = None if base is None else _pipeline_index(pathlib.Path(base))
    config = run_folder.load_run(run_dir)
    with checkpoint.Checkpoints(run_dir / run_folder.CHECKPOINTS) as checkpoints:
        steps = checkpoints.steps()
        if not steps:
            raise checkpoint.CheckpointError(f"export: the run in {str(run_dir)!r} has no checkpoint")
        step = steps[-1] if step is None else step
        layout = checkpoints.layout(step)  # a CheckpointError lists the steps when there is no such one
        role = _choose_role(layout, role, run_dir)
        if ema and _has_no_tensors(layout["roles"][role].get("ema")):
            raise ValueError(f"export --ema: role {role!r} of the run in {str(run_dir)!r} keeps no EMA params")
        trained = checkpoints.read(step, ("roles", role, "ema" if ema else "params"))
    model = role_configs(config)[role].build()
    if lora is not None and model.export_adapters is None:
        raise ValueError(f"export --lora: role {role!r} of the run in {str(run_dir)!r} trains no adapters (its model "
                         "config has no lora); export it without --lora")
    sampling_of = getattr(config.method, "sampling", None)
    sampling = None if sampling_of is None else sampling_of(role)
    manifest = {"run": str(run_dir.absolute()), "step": step, "role": role, "ema": ema, "sampling": sampling,
                "base": None if base is None else str(pathlib.Path(base).absolute())}
    if lora != "merged" and lora is not None:
        files = model.export_adapters(trained, str(out), lora)
        (out / MANIFEST).write_text(json.dumps({**manifest, "lora": lora}, indent=2) + "\n")
        return Exported(out, step, role, ema, tuple(path.name for path in files), sampling)
    model.export(role_params(config, role, model, trained), str(out))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    components = tuple(sorted(p.name for p in out.iterdir() if (p / "config.json").is_file()))
    if base_index is not None:
        _link_base(pathlib.Path(base), base_index, out)
    return Exported(out, step, role, ema, components, sampling)


def role_params(config: Any, role: str, model: Any, trained: Any) -> Any:
    """Role ``role``'s whole params for ``model``: ``trained`` (its params or EMA from a checkpoint) with the base it
    holds frozen (a LoRA base, an expert left frozen), made as the run made it."""
    if model.base_id() is None:
        return trained
    method_key, _ = run_keys(config.run.seed)
    program = config.method.build(build_models(config), total_steps=config.run.steps)  # no data needed
    return fvx_role.with_trained(program.frozen(method_key)[role], trained)


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


def _choose_role(layout: dict, role: str | None, run_dir: pathlib.Path) -> str:
    trained = sorted(layout.get("roles") or {})
    if role is None and "student" in trained:
        return "student"
    if role is None:
        if len(trained) != 1:
            raise ValueError(f"export: the run in {str(run_dir)!r} trains roles {', '.join(trained)}; choose one with "
                             "--role")
        return trained[0]
    if role not in trained:
        raise ValueError(f"export: the run in {str(run_dir)!r} did not train role {role!r}; trained roles: "
                         f"{', '.join(trained) or 'none'}")
    return role


def _has_no_tensors(node) -> bool:
    return node is None or not checkpoint.leaves_by_name(node)
