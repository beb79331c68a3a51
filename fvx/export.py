"""Export a trained role of a run as a diffusers folder: ``export(run_dir, out, step=None, role=None, ema=False)``.

The folder gets what the role's model family writes (``Model.export``): its pipeline components (``transformer/``;
``transformer/`` and ``transformer_2/`` for two experts: config.json + safetensors, loadable by the component class's
``from_pretrained``) and pipeline files (``model_index.json``, ``scheduler/``), plus ``fvx_export.json`` (run folder,
step, role, EMA or not). fvx trains transformers only: a pipeline that ``DiffusionPipeline.from_pretrained`` loads
also needs the base model's VAE, text encoder and tokenizer, copied beside them. The family's folder is written
beside ``out`` and renamed into place, so an error leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import NamedTuple

from fvx import checkpoint, loop

MANIFEST = "fvx_export.json"


class Exported(NamedTuple):
    """Where an export went and what it holds."""

    folder: pathlib.Path
    step: int
    role: str
    ema: bool
    components: tuple[str, ...]  # the pipeline component folders written (transformer/, ...)


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, role: str | None = None,
           ema: bool = False) -> Exported:
    """Write role ``role``'s params (its EMA params with ``ema``) of checkpoint ``step`` (default: the newest) of the
    run in ``run_dir`` to the diffusers folder ``out``. ``role`` may be left out when the run trains one role."""
    run_dir, out = pathlib.Path(run_dir), pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export: {str(out)!r} already exists and is not an empty folder")
    config = loop.load_run(run_dir)
    with checkpoint.Checkpoints(run_dir / loop.CHECKPOINTS) as checkpoints:
        steps = checkpoints.steps()
        if not steps:
            raise checkpoint.CheckpointError(f"export: the run in {str(run_dir)!r} has no checkpoint")
        step = steps[-1] if step is None else step
        layout = checkpoints.layout(step)  # a CheckpointError lists the steps when there is no such one
        role = _choose_role(layout, role, run_dir)
        if ema and _has_no_tensors(layout["roles"][role].get("ema")):
            raise ValueError(f"export --ema: role {role!r} of the run in {str(run_dir)!r} keeps no EMA params")
        params = checkpoints.read(step, ("roles", role, "params"))
        if ema:  # the EMA covers the params the role trains; the others are exported as they are
            params = {**params, **checkpoints.read(step, ("roles", role, "ema"))}
    model = loop.role_configs(config)[role].build()
    model.export(params, str(out))
    manifest = {"run": str(run_dir.absolute()), "step": step, "role": role, "ema": ema}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    components = tuple(sorted(p.name for p in out.iterdir() if (p / "config.json").is_file()))
    return Exported(out, step, role, ema, components)


def _choose_role(layout: dict, role: str | None, run_dir: pathlib.Path) -> str:
    trained = sorted(layout.get("roles") or {})
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
