"""LoRA adapter files that other tools load: PEFT/diffusers safetensors and ComfyUI's layout.

``peft``: ``pytorch_lora_weights.safetensors`` with the keys diffusers' ``save_lora_weights`` writes
(``transformer.<module>.lora_A.weight`` ``[r, in]``, ``lora_B.weight`` ``[out, r]``) and the adapter's PEFT
``LoraConfig`` (r, lora_alpha, target_modules, ...) in the ``lora_adapter_metadata`` entry of the file's metadata, as
diffusers writes it, so ``pipe.load_lora_weights(folder)`` scales by alpha / r as fvx does. ``comfyui``:
``diffusion_model.<original module>.lora_down.weight`` (A), ``lora_up.weight`` (B) and ``.alpha``, under the
family's original (non-diffusers) module names (``Family.comfyui_name``). A model of two components (Wan 2.2's
experts) gets one file per component; the first is named as above, the others ``<stem>_<component>.safetensors``.
"""
from __future__ import annotations

import json
import pathlib
from typing import Mapping

import torch
from safetensors.torch import save_file

from fvx_models import lora as flora

FORMATS = ("peft", "comfyui")
PEFT_FILE = "pytorch_lora_weights.safetensors"
COMFYUI_FILE = "lora_comfyui.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # where diffusers reads a LoRA's config


def by_component(adapters: flora.Adapters, params: Mapping[str, torch.Tensor]
                 ) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Component -> its adapted module names (without the component prefix) -> (A, B), fp32 on the CPU."""
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for component, prefix in adapters.family.components.items():
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


def comfyui_file(config: flora.LoRAConfig, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], family
                 ) -> dict[str, torch.Tensor]:
    """One component's LoRA in ComfyUI's layout; a ValueError names a module without an original name."""
    if family.comfyui_name is None:
        raise ValueError(f"export --format comfyui: family {family.name} has no ComfyUI layout in fvx; use --format "
                         "peft (diffusers' load_lora_weights) or merged")
    alpha = torch.tensor(float(config.rank if config.alpha is None else config.alpha))
    tensors = {}
    for name, (a, b) in pairs.items():
        original = family.comfyui_name(name)
        if original is None:
            raise ValueError(f"export --format comfyui: module {name!r} has no ComfyUI name in family "
                             f"{family.name}; adapt only the blocks' attention and feed-forward layers, or use --format "
                             "peft")
        tensors[f"diffusion_model.{original}.lora_down.weight"] = a
        tensors[f"diffusion_model.{original}.lora_up.weight"] = b
        tensors[f"diffusion_model.{original}.alpha"] = alpha.clone()
    return tensors


def write(adapters: flora.Adapters, params: Mapping[str, torch.Tensor], folder: str | pathlib.Path,
          form: str) -> list[pathlib.Path]:
    """Write the adapters ``params`` (the role's trained params) in format ``form`` into ``folder``; returns the
    files."""
    if form not in FORMATS:
        raise ValueError(f"export --format must be one of {', '.join(FORMATS)} or merged, got {form!r}")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = PEFT_FILE if form == "peft" else COMFYUI_FILE
    written = []
    for i, (component, pairs) in enumerate(by_component(adapters, params).items()):
        path = folder / (stem if i == 0 else stem.replace(".safetensors", f"_{component}.safetensors"))
        if form == "peft":
            tensors, metadata = peft_file(adapters.config, pairs)
            save_file(tensors, str(path), metadata=metadata)
        else:
            save_file(comfyui_file(adapters.config, pairs, adapters.family), str(path), metadata={"format": "pt"})
        written.append(path)
    return written
