"""LoRA as a model transform: low-rank adapters on a frozen base, any family (FastVideo's LoRA, spec §5.3).

Each targeted ``nn.Linear`` of the skeleton (a module whose name contains one of ``target_modules``) gets two
adapter params, ``<name>.lora_A.weight [r, in]`` and ``<name>.lora_B.weight [out, r]`` (PEFT's names), and computes

    y = base(x) + ((alpha / r) x A^T) B^T

as an *adapter*: the low-rank path is added to the base layer's output (a forward hook, :func:`add_low_rank`), so
autograd never forms a full weight gradient and no merged weight is kept for the backward. The adapters are ordinary
params of the skeleton, so remat, unit groups, sharding, compute dtype and compilation apply to them as to any other; a
role trains only them while the base is a frozen argument. Init: A as ``nn.Linear``'s default (kaiming-uniform, a =
sqrt(5): U(+-1 / sqrt(in))), or ``gaussian`` N(0, 1/r) as PEFT's; B zeros, so an untrained adapter leaves the base's
output unchanged.
"""
from __future__ import annotations

import functools
import math
import zlib
from typing import Annotated, Any, Callable, Literal, NamedTuple

import msgspec
import torch
from torch import nn

from fvx.config import Config
from fvx.core import random

A, B = "lora_A.weight", "lora_B.weight"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "to_q", "to_k", "to_v", "to_out", "to_qkv",
                   "to_gate_compress")  # FastVideo's defaults, matched as substrings of module names


class LoRAConfig(Config):
    """Low-rank adapters on a model's linear layers: ``rank`` r, ``alpha`` (None: r; the update is scaled by
    alpha / r), ``target_modules`` (substrings of module names; every ``nn.Linear`` whose name contains one is
    adapted) and ``init`` of A (``kaiming``: nn.Linear's default, as FastVideo; ``gaussian``: N(0, 1/r), as PEFT's)."""

    rank: Annotated[int, msgspec.Meta(gt=0)] = 16
    alpha: Annotated[float, msgspec.Meta(gt=0)] | None = None
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    init: Literal["kaiming", "gaussian"] = "kaiming"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if self.alpha is not None and not (0 < self.alpha < math.inf):
            raise ValueError(f"lora.alpha must be a positive number (or None: the rank), got {self.alpha!r}")
        if not self.target_modules or not all(self.target_modules):
            raise ValueError(f"lora.target_modules must name at least one module (substrings of module names), got "
                             f"{list(self.target_modules)}")

    @property
    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


class Adapters(NamedTuple):
    """A LoRA model's adapters as export sees them: the config, the adapted module names (with their component
    prefix, e.g. ``blocks.0.attn1.to_q``) and the family (its components and ComfyUI names)."""

    config: LoRAConfig
    modules: tuple[str, ...]
    family: Any


def targets(module: nn.Module, config: LoRAConfig, who: str,
            frozen: Callable[[str], bool] = lambda name: False) -> dict[str, nn.Linear]:
    """The linear layers ``config`` adapts, by name, but those ``frozen`` names (a branch the model does not train:
    LTX-2's audio); a ValueError lists some module names when none matches, or names a target narrower than the
    rank."""
    found = {name: part for name, part in module.named_modules()
             if isinstance(part, nn.Linear) and any(pattern in name for pattern in config.target_modules)
             and not frozen(f"{name}.weight")}
    if not found:
        linears = [name for name, part in module.named_modules() if isinstance(part, nn.Linear)]
        raise ValueError(f"{who} lora.target_modules {list(config.target_modules)} match no linear layer; some of "
                         f"its linear layers: {', '.join(_examples(linears))}")
    for name, linear in found.items():
        if config.rank > min(linear.in_features, linear.out_features):
            raise ValueError(f"{who} lora.rank {config.rank} exceeds the dimensions of target {name!r} "
                             f"({linear.out_features} x {linear.in_features})")
    return found


def _examples(names: list[str]) -> list[str]:
    """A few distinct module names, with block indices collapsed (``blocks.N.attn1.to_q``)."""
    seen = dict.fromkeys(".".join("N" if piece.isdigit() else piece for piece in name.split(".")) for name in names)
    return list(seen)[:12]


def install(module: nn.Module, config: LoRAConfig, who: str,
            frozen: Callable[[str], bool] = lambda name: False) -> tuple[str, ...]:
    """Add the adapters to ``module``'s targets (but ``frozen`` params' layers), on meta, with the forward hook adding
    their path (module docstring); returns the adapted module names."""
    found = targets(module, config, who, frozen)
    for linear in found.values():
        with torch.device("meta"):
            linear.lora_A = nn.Linear(linear.in_features, config.rank, bias=False)
            linear.lora_B = nn.Linear(config.rank, linear.out_features, bias=False)
        linear.register_forward_hook(functools.partial(add_low_rank, scale=config.scale))
    return tuple(found)


def add_low_rank(layer: nn.Linear, args: tuple, out: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The forward hook: ``out + (scale x A^T) B^T``, the scale on the rank-r activations and the sum inside B's
    GEMM (``addmm``), so no elementwise pass over the ``[tokens, out]`` output is added to the base layer's."""
    low = layer.lora_A(args[0])
    if scale != 1.0:
        low = low * scale
    flat = torch.addmm(out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), layer.lora_B.weight.t())
    return flat.view(out.shape)


def adapter_names(adapted: tuple[str, ...]) -> tuple[str, ...]:
    """The adapter params of the adapted modules, A then B of each."""
    return tuple(f"{name}.{part}" for name in adapted for part in (A, B))


def init_adapters(module: nn.Module, adapted: tuple[str, ...], key: torch.Tensor,
                  config: LoRAConfig) -> dict[str, torch.Tensor]:
    """Fresh fp32 adapters: A by ``config.init`` from ``fold_in(key, crc32(name))``, B zeros."""
    params = {}
    for name in adapted:
        linear = module.get_submodule(name)
        a_shape = (config.rank, linear.in_features)
        a_key = random.fold_in(key, zlib.crc32(f"{name}.{A}".encode()))
        if config.init == "gaussian":
            params[f"{name}.{A}"] = random.normal(a_key, a_shape) / config.rank
        else:
            bound = 1.0 / math.sqrt(linear.in_features)
            params[f"{name}.{A}"] = random.uniform(a_key, a_shape, minval=-bound, maxval=bound)
        params[f"{name}.{B}"] = torch.zeros(linear.out_features, config.rank)
    return params


def merged(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], adapted: tuple[str, ...],
           scale: float) -> dict[str, torch.Tensor]:
    """The base's params with each adapted weight replaced by ``W + scale * B A`` (fp32, in the base's dtype)."""
    out = dict(base)
    for name in adapted:
        weight = base[f"{name}.weight"]
        delta = adapters[f"{name}.{B}"].float() @ adapters[f"{name}.{A}"].float()
        out[f"{name}.weight"] = (weight.float() + scale * delta).to(weight.dtype)
    return out
