"""Whole weights in a family's original checkpoint layout (``Family.checkpoints.original_name``; Wan: Wan-AI's names,
the layout ComfyUI's "Load Diffusion Model" node, musubi-tuner's ``--dit`` and the original repositories load): one
safetensors file per pipeline component, ``<stem>.safetensors`` (``stem``: what the caller calls the export, e.g. the run;
``diffusion_model`` by default), and for a model of two experts (Wan 2.2 A14B) ``<stem>_high_noise.safetensors`` and
``<stem>_low_noise.safetensors``, as ComfyUI's and musubi-tuner's Wan 2.2 files are named. diffusers' single-file
converter reads them back to the same tensors.
"""
from __future__ import annotations

import os
import pathlib
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import save_file

from fvx_models import diffusers_folder as dfolder
from fvx_models.model import Written

DEFAULT_STEM = "diffusion_model"  # the file's name when the caller gives none


def component_tag(family: Any, component: str) -> str:
    """What tells ``component``'s file from the others': nothing for a model of one component, else its
    ``Family.checkpoints.component_tags`` entry (Wan 2.2's ``high_noise``, ``low_noise``), or its own name."""
    checkpoints = family.checkpoints
    return "" if len(checkpoints.components) == 1 else checkpoints.component_tags.get(component, component)


def file_name(parts: tuple[str | None, ...], family: Any, component: str) -> str:
    """``<parts>_<tag>.safetensors``: the non-empty ``parts`` and ``component``'s tag joined by ``_`` (a LoRA's files
    follow the same rule: ``<run>_lora_comfyui_high_noise.safetensors``)."""
    return "_".join(part for part in (*parts, component_tag(family, component)) if part) + ".safetensors"


def musubi_flag(flag: str, family: Any, component: str) -> str:
    """musubi-tuner's ``wan_generate_video.py`` flag for ``component``'s file: ``flag`` (``--dit``, ``--lora_weight``)
    for a single model and for the low-noise expert, ``<flag>_high_noise`` for the high-noise expert."""
    return flag + ("_high_noise" if component_tag(family, component) == "high_noise" else "")


def renamed(params: Mapping[str, torch.Tensor], family: Any, prefix: str, what: str) -> dict[str, torch.Tensor]:
    """The params under ``prefix`` (one component's) by their original names; a ValueError names the params the
    original layout has no name for."""
    names = {name: family.checkpoints.original_name(name[len(prefix):]) for name in params if name.startswith(prefix)}
    unnamed = [name for name, original in names.items() if original is None]
    if unnamed:
        raise ValueError(f"{what}: the original {family.name} layout has no name for {dfolder.listed(unnamed)}; "
                         "export --format diffusers")
    return {original: params[name] for name, original in names.items()}


def write(params: Mapping[str, torch.Tensor], folder: str | os.PathLike, family: Any, what: str, *,
          dtype_of: Callable[[str], torch.dtype | None], stem: str | None = None) -> Written:
    """Write whole ``params`` in ``family``'s original layout into ``folder`` (written as ``diffusers_folder.staged``
    writes) as ``<stem>[_<expert>].safetensors``; ``dtype_of(name)`` casts a floating-point param (None: keep)."""
    if family.checkpoints.original_name is None:
        raise ValueError(f"{what}: family {family.name} has no original layout in fvx; export --format diffusers")
    files = {}
    with dfolder.staged(folder, what) as staging:
        for component, prefix in family.checkpoints.components.items():
            tensors = renamed({name: dfolder.exported(p, dtype_of(name)) for name, p in params.items()
                               if name.startswith(prefix)}, family, prefix, what)
            file = file_name((stem or DEFAULT_STEM,), family, component)
            save_file(tensors, str(staging / file), metadata={"format": "pt"})
            files[component] = pathlib.Path(folder) / file
    return Written(files, tuple(how_to_load(files, family)))


def how_to_load(written: Mapping[str, pathlib.Path], family: Any) -> list[str]:
    """What a person does with the files :func:`write` wrote (component -> file), one line per file: ComfyUI's node,
    and musubi-tuner's ``wan_generate_video.py`` flag (``--dit``; ``--dit_high_noise`` for the high-noise expert)."""
    lines = []
    for component, path in written.items():
        note = family.checkpoints.component_notes.get(component)
        flag = musubi_flag("--dit", family, component)
        lines.append(f"ComfyUI: put {path.name} in models/diffusion_models/ and load it with a Load Diffusion Model "
                     "node" + (f" ({component}: {note})" if note else "")
                     + f"; musubi-tuner: wan_generate_video.py {flag} {path}")
    return lines
