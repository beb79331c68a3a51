"""Whole weights in a family's original checkpoint layout (``Family.original_name``; Wan: Wan-AI's names, the layout
ComfyUI's "Load Diffusion Model" node and the original repositories load): one safetensors file per pipeline
component, ``diffusion_model.safetensors`` for the first and ``diffusion_model_<component>.safetensors`` for the
others (Wan 2.2 A14B's ``transformer_2``). diffusers' single-file converter reads them back to the same tensors.
"""
from __future__ import annotations

import os
import pathlib
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import save_file

from fvx_models import diffusers_folder as dfolder
from fvx_models.model import Written

FILE = "diffusion_model.safetensors"


def file_name(stem: str, components: Mapping[str, str], component: str) -> str:
    """The file of ``component`` among a model's ``components``: ``stem`` for the first, ``<stem>_<component>`` for
    the others (a LoRA's files follow the same rule)."""
    first = next(iter(components))
    return stem if component == first else stem.replace(".safetensors", f"_{component}.safetensors")


def renamed(params: Mapping[str, torch.Tensor], family: Any, prefix: str, what: str) -> dict[str, torch.Tensor]:
    """The params under ``prefix`` (one component's) by their original names; a ValueError names the params the
    original layout has no name for."""
    names = {name: family.original_name(name[len(prefix):]) for name in params if name.startswith(prefix)}
    unnamed = [name for name, original in names.items() if original is None]
    if unnamed:
        raise ValueError(f"{what}: the original {family.name} layout has no name for {dfolder.listed(unnamed)}; "
                         "export --format diffusers")
    return {original: params[name] for name, original in names.items()}


def write(params: Mapping[str, torch.Tensor], folder: str | os.PathLike, family: Any, what: str, *,
          dtype_of: Callable[[str], torch.dtype | None]) -> Written:
    """Write whole ``params`` in ``family``'s original layout into ``folder`` (written as ``diffusers_folder.staged``
    writes); ``dtype_of(name)`` casts a floating-point param (None: keep)."""
    if family.original_name is None:
        raise ValueError(f"{what}: family {family.name} has no original layout in fvx; export --format diffusers")
    files = {}
    with dfolder.staged(folder, what) as staging:
        for component, prefix in family.components.items():
            tensors = renamed({name: dfolder.exported(p, dtype_of(name)) for name, p in params.items()
                               if name.startswith(prefix)}, family, prefix, what)
            name = file_name(FILE, family.components, component)
            save_file(tensors, str(staging / name), metadata={"format": "pt"})
            files[component] = pathlib.Path(folder) / name
    return Written(files, tuple(how_to_load(files, family)))


def how_to_load(written: Mapping[str, pathlib.Path], family: Any) -> list[str]:
    """What a person does with the files :func:`write` wrote (component -> file), one line per file."""
    lines = []
    for component, path in written.items():
        note = family.component_notes.get(component)
        lines.append(f"ComfyUI: put {path.name} in models/diffusion_models/ and load it with a Load Diffusion Model "
                     "node" + (f" ({component}: {note})" if note else ""))
    return lines
