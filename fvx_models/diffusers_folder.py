"""Reading a local diffusers component folder (``config.json`` + safetensors weights) and checking it against a
skeleton module: the parts every model family's ``load`` shares. Never pickle, never a hub.

Every error is a ValueError that starts with ``what`` (e.g. ``"Wan load"``) and names the file and the differences.
"""
from __future__ import annotations

import inspect
import json
import pathlib
from typing import Any, Iterable, Mapping

from safetensors import safe_open
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
LIST_LIMIT = 10  # names shown per category in an error message


def listed(items: list[str]) -> str:
    """The first ``LIST_LIMIT`` items joined, with how many more there are."""
    shown = ", ".join(items[:LIST_LIMIT])
    return shown + (f", ... and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else "")


def component_folder(folder: pathlib.Path, subfolder: str, what: str, kind: str) -> pathlib.Path:
    """``folder`` when it holds a config.json, else ``folder/subfolder`` (a pipeline root)."""
    if (folder / CONFIG_NAME).is_file():
        return folder
    if (folder / subfolder / CONFIG_NAME).is_file():
        return folder / subfolder
    raise ValueError(
        f"{what}: no {CONFIG_NAME} in {str(folder)!r} nor in {str(folder / subfolder)!r}; expected a diffusers "
        f"{kind} folder or a pipeline root holding one under {subfolder}/"
    )


def check_config(folder: pathlib.Path, module: nn.Module, what: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The folder's config.json; a ValueError lists each architecture field (but ``skip``) where it differs from
    ``module.config`` (fields the file leaves out take the class's constructor defaults, as diffusers does)."""
    cls, path = type(module), folder / CONFIG_NAME
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(stored, dict):
        raise ValueError(f"{what}: {str(path)!r} does not hold a JSON object")
    class_name = stored.get("_class_name", cls.__name__)
    if class_name != cls.__name__:
        raise ValueError(f"{what}: {str(path)!r} describes a {class_name}, not a {cls.__name__}")
    defaults = constructor_defaults(cls)
    skip = set(skip)
    differences = [
        f"{field}: folder has {stored.get(field, defaults.get(field))!r}, expected {expected!r}"
        for field, expected in module.config.items()
        if not field.startswith("_") and field not in skip
        and _comparable(stored.get(field, defaults.get(field))) != _comparable(expected)
    ]
    if differences:
        raise ValueError(f"{what}: {str(path)!r} does not match the model's architecture: " + "; ".join(differences))
    return stored


def constructor_defaults(cls: type) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}


def _comparable(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def weight_files(folder: pathlib.Path, what: str) -> list[pathlib.Path]:
    """The safetensors files holding the weights: the single file, or the shards an index json names."""
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    index_path = folder / WEIGHTS_INDEX_NAME
    if not index_path.is_file():
        raise ValueError(f"{what}: no {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} in {str(folder)!r} "
                         "(fvx reads safetensors only)")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{what}: {str(index_path)!r} is not a safetensors index with a weight_map: {error}") from None
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise ValueError(f"{what}: shards named in {str(index_path)!r} are missing: {listed(missing)}")
    return files


def stored_shapes(files: Iterable[pathlib.Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the safetensors ``files``, read from their headers (no data)."""
    shapes = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def shape_problems(required: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]],
                   known: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """``"missing keys (n): ..."``, ``"unexpected keys (n): ..."`` and ``"shape mismatches (n): ..."`` of ``found``
    against ``required`` (every one must be there) and ``known`` (what may be there; default ``required``)."""
    known = required if known is None else known
    missing = [name for name in required if name not in found]
    unexpected = [name for name in found if name not in known]
    mismatched = [f"{name}: {list(found[name])} vs expected {list(shape)}"
                  for name, shape in known.items() if name in found and tuple(found[name]) != tuple(shape)]
    return [f"{label} ({len(items)}): {listed(items)}"
            for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                 ("shape mismatches", mismatched)) if items]
