"""LoRA adapter files that other tools load: PEFT/diffusers safetensors, ComfyUI's layout and musubi-tuner's.

``peft``: ``pytorch_lora_weights.safetensors`` (diffusers' name, which ``load_lora_weights(folder)`` looks for) with
the keys diffusers' ``save_lora_weights`` writes (``transformer.<module>.lora_A.weight`` ``[r, in]``,
``lora_B.weight`` ``[out, r]``) and the adapter's PEFT ``LoraConfig`` (r, lora_alpha, target_modules, ...) in the
``lora_adapter_metadata`` entry of the file's metadata, as diffusers writes it, so ``pipe.load_lora_weights(folder)``
scales by alpha / r as fvx does; ComfyUI and musubi-tuner load none of these keys. ``comfyui``
(``<stem>_lora_comfyui.safetensors``, ``stem`` e.g. the run's name): ``diffusion_model.<original module>
.lora_down.weight`` (A), ``lora_up.weight`` (B) and ``.alpha``, under the family's original module names
(``Family.checkpoints.original_name``).
``musubi`` (``<stem>_lora_musubi.safetensors``): kohya's keys, which musubi-tuner applies
(and ComfyUI reads too): ``lora_unet_<original module, dots as underscores>.lora_down.weight``, ``lora_up.weight``,
``.alpha``. A model of two components (Wan 2.2's experts) gets one file per component: diffusers'
``pytorch_lora_weights_transformer_2.safetensors`` for PEFT, ``..._high_noise`` / ``..._low_noise`` for the others
(``original_layout.file_name``).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from fvx_models import diffusers_folder as dfolder, lora as flora, original_layout
from fvx_models.model import Written

FORMATS = ("peft", "comfyui", "musubi")
PEFT_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE, what load_lora_weights looks for
ORIGINAL_KEYS = {"comfyui": lambda original: f"diffusion_model.{original}",
                 "musubi": lambda original: "lora_unet_" + original.replace(".", "_")}
"""A LoRA module's key stem in each layout, from its original module name (``blocks.0.self_attn.q``)."""
METADATA_KEY = "lora_adapter_metadata"  # where diffusers reads a LoRA's config


def by_component(adapters: flora.Adapters, params: Mapping[str, torch.Tensor]
                 ) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Component -> its adapted module names (without the component prefix) -> (A, B), fp32 on the CPU."""
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for component, prefix in adapters.family.checkpoints.components.items():
        pairs = {name[len(prefix):]: (_cpu(params[f"{name}.{flora.A}"]), _cpu(params[f"{name}.{flora.B}"]))
                 for name in adapters.modules if name.startswith(prefix)}
        if pairs:
            out[component] = pairs
    return out


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float32).contiguous()


def peft_config(config: flora.LoRAConfig, modules: list[str]) -> dict:
    """The PEFT ``LoraConfig`` fields of the adapter (what diffusers builds the adapter from)."""
    return {"r": config.rank, "lora_alpha": config.rank if config.alpha is None else config.alpha,
            "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none", "use_dora": False,
            "use_rslora": False, "init_lora_weights": "gaussian" if config.init == "gaussian" else True}


def peft_file(config: flora.LoRAConfig, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of one component's PEFT/diffusers LoRA file."""
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"transformer.{name}.{flora.A}"] = a
        tensors[f"transformer.{name}.{flora.B}"] = b
    packed = {f"transformer.{key}": value for key, value in peft_config(config, list(pairs)).items()}
    return tensors, {"format": "pt", METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True)}


def original_file(form: str, config: flora.LoRAConfig, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                  family) -> dict[str, torch.Tensor]:
    """One component's LoRA in ComfyUI's or musubi-tuner's layout (module docstring); a ValueError names a module the
    family's original layout has no name for."""
    if family.checkpoints.original_name is None:
        raise ValueError(f"export --format {form}: family {family.name} has no original layout in fvx; use --format "
                         "peft (diffusers' load_lora_weights) or export the merged weights without --lora")
    alpha = torch.tensor(float(config.rank if config.alpha is None else config.alpha))
    tensors = {}
    for name, (a, b) in pairs.items():
        original = family.checkpoints.original_name(name)
        if original is None:
            raise ValueError(f"export --format {form}: module {name!r} has no name in the original {family.name} "
                             "layout; use --format peft")
        key = ORIGINAL_KEYS[form](original)
        tensors[f"{key}.lora_down.weight"] = a
        tensors[f"{key}.lora_up.weight"] = b
        tensors[f"{key}.alpha"] = alpha.clone()
    return tensors


def formats(family) -> tuple[str, ...]:
    """The formats a LoRA of ``family`` exports in (the original layout's tools when the family has one)."""
    checkpoints = family.checkpoints
    return ("peft",) + (checkpoints.original_formats if checkpoints.original_name is not None else ())


def file_name(form: str, family: Any, component: str, stem: str | None = None) -> str:
    """The file of ``component``'s adapters in format ``form``: diffusers' names for ``peft``
    (``pytorch_lora_weights.safetensors``, ``pytorch_lora_weights_<component>.safetensors`` for the second expert),
    ``<stem>_lora_<form>[_high_noise|_low_noise].safetensors`` for the original layouts."""
    if form == "peft":
        first = next(iter(family.checkpoints.components))
        return PEFT_FILE if component == first else PEFT_FILE.replace(".safetensors", f"_{component}.safetensors")
    return original_layout.file_name((stem, "lora", form), family, component)


def write(adapters: flora.Adapters, params: Mapping[str, torch.Tensor], folder: str | pathlib.Path,
          form: str, stem: str | None = None) -> Written:
    """Write the adapters ``params`` (the role's trained params) in format ``form`` into ``folder`` (written as
    ``diffusers_folder.staged`` writes), the original layouts' files named after ``stem`` (:func:`file_name`)."""
    if form not in FORMATS:
        raise ValueError(f"export --lora --format must be one of {', '.join(FORMATS)}, got {form!r}")
    if form not in formats(adapters.family):
        raise ValueError(f"export --lora --format {form}: a {adapters.family.name} LoRA exports as "
                         f"{', '.join(formats(adapters.family))}")
    written = {}
    with dfolder.staged(folder, f"export --lora --format {form}") as staging:
        for component, pairs in by_component(adapters, params).items():
            name = file_name(form, adapters.family, component, stem)
            if form == "peft":
                tensors, metadata = peft_file(adapters.config, pairs)
                save_file(tensors, str(staging / name), metadata=metadata)
            else:
                save_file(original_file(form, adapters.config, pairs, adapters.family), str(staging / name),
                          metadata={"format": "pt"})
            written[component] = pathlib.Path(folder) / name
    return Written(written, tuple(how_to_load(form, written, adapters.family)))


def how_to_load(form: str, written: Mapping[str, pathlib.Path], family) -> list[str]:
    """What a person runs to load the files :func:`write` wrote (component -> file), one line per file; after PEFT
    files, a line saying that ComfyUI and musubi-tuner load none of their keys and which format they load."""
    first = next(iter(family.checkpoints.components))
    lines = []
    for component, path in written.items():
        note = family.checkpoints.component_notes.get(component)
        which = f" ({component}: {note})" if note else ""
        if form == "peft":
            args = [repr(str(path.parent)), *([f"weight_name={path.name!r}"] if path.name != PEFT_FILE else []),
                    *([f"load_into_{component}=True"] if component != first else [])]
            lines.append(f"pipe.load_lora_weights({', '.join(args)})" + (f"  # {component}: {note}" if note else ""))
        elif form == "comfyui":
            lines.append(f"ComfyUI: put {path.name} in models/loras/ and apply it with a LoraLoaderModelOnly node"
                         f"{which}")
        else:
            flag = original_layout.musubi_flag("--lora_weight", family, component)
            lines.append(f"musubi-tuner: {family.checkpoints.musubi_script} {flag} {path}{which}")
    checkpoints = family.checkpoints
    if form == "peft" and checkpoints.original_name is not None and "comfyui" in checkpoints.original_formats:
        lines.append("not for ComfyUI or musubi-tuner: they ignore PEFT keys (transformer.<module>.lora_A/lora_B) and "
                     "load nothing from a PEFT file; export again with --lora --format comfyui (ComfyUI's "
                     f"LoraLoaderModelOnly) or --lora --format musubi (musubi-tuner's {checkpoints.musubi_script} "
                     "--lora_weight)")
    elif form == "peft" and checkpoints.original_name is not None:
        lines.append(f"musubi-tuner's {checkpoints.musubi_script} reads these keys but scales them as if alpha were "
                     "the rank; export again with --lora --format musubi, which keeps the adapter's alpha")
    return lines
