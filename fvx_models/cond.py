"""Conditioning as a family declares it: a ``cond`` dict of tensors with a leading batch dim, checked against the
family's spec, unconditional variants for classifier-free guidance, and cond files.

A spec maps each cond tensor's name to its shape after the batch dim; ``"L"`` is the text length, any length but the
same in every tensor of one cond (Wan: ``{"text": ("L", 4096), "text_mask": ("L",)}``; HunyuanVideo adds
``"pooled": (768,)``). A cond file is a safetensors file holding the family's cond tensors, ``[N, ...]`` (or without
the leading dim for one row), with optional captions as a JSON list in its metadata under ``captions``: negative
prompts and validation prompts are cond files. Nothing here knows a family.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Callable, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

Spec = Mapping[str, tuple]
Cond = dict[str, torch.Tensor]
TEXT_LENGTH = "L"
UNCOND_MODES = ("negative_prompt", "zero", "keep")


def describe(spec: Spec, batch: int | str = "B") -> str:
    return ", ".join(f"{name} [{', '.join(map(str, (batch, *shape)))}]" for name, shape in spec.items())


def check(cond: Mapping[str, torch.Tensor], spec: Spec, who: str, *, batch: int | None = None,
          where: str = "cond") -> None:
    """A ValueError naming the tensor and ``who`` (the family) unless ``cond`` holds exactly ``spec``'s tensors, each
    ``[B, *shape]`` with one B (``batch`` when given) and one text length."""
    if not isinstance(cond, Mapping):
        raise ValueError(f"{who}: {where} must be a mapping of tensors ({describe(spec)}), got {type(cond).__name__}")
    missing = [name for name in spec if name not in cond]
    unexpected = [name for name in cond if name not in spec]
    if missing or unexpected:
        raise ValueError(f"{who}: {where} has tensors {sorted(cond)}; it takes {describe(spec)}"
                         + (f" (missing {missing})" if missing else "") + (f" (unknown {unexpected})" if unexpected else ""))
    sizes: dict[str, int] = {}
    for name, shape in spec.items():
        tensor = cond[name]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 + len(shape):
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{who}: {where}[{name!r}] must be [B, {', '.join(map(str, shape))}], got {got}")
        for symbol, size in zip(("B", *shape), tensor.shape):
            if isinstance(symbol, int):
                if size != symbol:
                    raise ValueError(f"{who}: {where}[{name!r}] must be [B, {', '.join(map(str, shape))}], got "
                                     f"{list(tensor.shape)}")
            elif sizes.setdefault(symbol, size) != size:
                what = {"B": "the batch", TEXT_LENGTH: "the text length"}.get(symbol, f"size {symbol}")
                raise ValueError(f"{who}: {where} tensors disagree on {what}: {where}[{name!r}] has {size}, "
                                 f"another has {sizes[symbol]}")
    if batch is not None and sizes.get("B", batch) != batch:
        raise ValueError(f"{who}: {where} has {sizes['B']} rows for a batch of {batch}")


def rows(cond: Mapping[str, torch.Tensor]) -> int:
    """The batch size of a cond."""
    return next(iter(cond.values())).shape[0]


def expand(cond: Mapping[str, torch.Tensor], batch: int) -> Cond:
    """A cond of one row repeated (as a view) for ``batch`` samples."""
    if rows(cond) != 1:
        raise ValueError(f"expand: a cond of one row is expected, got {rows(cond)}")
    return {name: t.expand(batch, *t.shape[1:]) for name, t in cond.items()}


def take(cond: Mapping[str, torch.Tensor], index: slice | torch.Tensor | Sequence[int]) -> Cond:
    """Rows ``index`` of every tensor."""
    return {name: t[index] for name, t in cond.items()}


def to(cond: Mapping[str, torch.Tensor], device: torch.device | str | None = None,
       dtype: torch.dtype | None = None) -> Cond:
    """Every tensor on ``device``; floating-point ones in ``dtype`` when given."""
    return {name: t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
            for name, t in cond.items()}


def zeros(cond: Mapping[str, torch.Tensor]) -> Cond:
    """The default "zero" unconditional: every tensor zeroed (FastVideo's ``cfg_uncond: zero``: embeddings and mask)."""
    return {name: torch.zeros_like(t) for name, t in cond.items()}


def zeros_keeping_masks(cond: Mapping[str, torch.Tensor]) -> Cond:
    """A "zero" unconditional that zeroes the embeddings and keeps the masks (``*_mask``), which only set how many
    tokens the DiT sees (Kandinsky's, as FastVideo's ``cfg_uncond.text=zero``)."""
    return {name: t if name.endswith("mask") else torch.zeros_like(t) for name, t in cond.items()}


def uncond(cond: Mapping[str, torch.Tensor], mode: str, negative: Mapping[str, torch.Tensor] | None = None, *,
           zero: Callable[[Mapping[str, torch.Tensor]], Cond] = zeros, kept: frozenset[str] = frozenset(),
           blank: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> Cond:
    """The unconditional cond for classifier-free guidance, batched like ``cond``: ``"keep"`` the cond itself,
    ``"zero"`` the family's zero cond (``zero``), ``"negative_prompt"`` the one-row ``negative`` expanded. The tensors
    ``kept`` (the given image of an image-to-video model: guidance is on the text only) stay the cond's, and those of
    ``blank`` are their transform of the cond's (Wan-Animate's blank face), in the last two modes."""
    if mode == "keep":
        return dict(cond)
    own = {**{name: cond[name] for name in kept}, **{name: f(cond[name]) for name, f in (blank or {}).items()}}
    if mode == "zero":
        return {**zero(cond), **own}
    if mode != "negative_prompt":
        raise ValueError(f"unknown unconditional mode {mode!r}; valid: {', '.join(UNCOND_MODES)}")
    if negative is None:
        raise ValueError("the unconditional mode 'negative_prompt' needs a negative-prompt cond file "
                         "(method.negative_prompt_path); or use 'zero' or 'keep'")
    any_tensor = next(iter(cond.values()))
    negative = expand(to(negative, any_tensor.device, any_tensor.dtype), rows(cond))
    return {**negative, **own}


# ------------------------------------------------------------------------------------------------------------ files


def load(path: str | os.PathLike, spec: Spec, who: str, *, defaults: Mapping[str, Callable] | None = None
         ) -> tuple[Cond, tuple[str, ...] | None]:
    """(cond ``[N, ...]`` fp32, captions or None) of a cond file, checked against ``spec``. A tensor the file leaves
    out is made by ``defaults[name](cond)`` when the family gives a default (a mask of ones), else an error."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{who}: cond file {str(path)!r} does not exist")
    try:
        with safe_open(path, framework="pt") as f:
            names, metadata = set(f.keys()), f.metadata() or {}
            tensors = {name: f.get_tensor(name).float() for name in names if name in spec}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{who}: cond file {str(path)!r} is not a readable safetensors file: {error}") from None
    for name, shape in spec.items():
        if name in tensors and tensors[name].dim() == len(shape):
            tensors[name] = tensors[name][None]  # one row without its batch dim
    for name, make in (defaults or {}).items():
        if name not in tensors and all(other in tensors for other in spec if other != name):
            tensors[name] = make(tensors)
    try:
        check(tensors, spec, who, where=f"cond file {str(path)!r}")
    except ValueError as error:
        raise ValueError(f"{error} (the file holds {sorted(names)})") from None
    return tensors, _captions(metadata, rows(tensors), path)


def save(path: str | os.PathLike, cond: Mapping[str, torch.Tensor], captions: Sequence[str] | None = None) -> None:
    """Write a cond file: ``cond``'s tensors ``[N, ...]`` and, when given, ``captions`` (N strings)."""
    tensors = {name: t.detach().float().cpu().contiguous() for name, t in cond.items()}
    metadata = {}
    if captions is not None:
        captions = list(captions)
        if len(captions) != rows(tensors) or not all(isinstance(c, str) for c in captions):
            raise ValueError(f"captions must be {rows(tensors)} strings, got {captions!r}")
        metadata["captions"] = json.dumps(captions)
    save_file(tensors, str(path), metadata=metadata)


def _captions(metadata: Mapping[str, str], count: int, path: pathlib.Path) -> tuple[str, ...] | None:
    if "captions" not in metadata:
        return None
    try:
        captions = json.loads(metadata["captions"])
    except json.JSONDecodeError:
        captions = None
    if not (isinstance(captions, list) and len(captions) == count and all(isinstance(c, str) for c in captions)):
        raise ValueError(f"cond file {str(path)!r}: metadata 'captions' must be a JSON list of {count} strings")
    return tuple(captions)
