"""NVFP4 quantization-aware training of linear layers: a chosen set of ``nn.Linear`` layers computes its forward from
NVFP4 quantize-dequantized activations and weights, its backward in full precision (FastVideo's
``nvfp4_qat_train``: ``NVFP4QATTrainQuantizeMethod`` through ``fp4linear._LinearFWD4BWD16Fn``).

NVFP4 here is the two-level form FastVideo's linear path uses (flashinfer's ``nvfp4_quantize`` with a global scale):
a tensor's global scale ``g = 448 * 6 / max(amax, 1e-12)`` (its ``_global_sf``), then blocks of 16 along the
reduction dim, each scaled by ``e4m3(block_amax * g / 6)`` and rounded to E2M1, and divided back by ``g``:
``fq(x) = fake_quantize(x * g) / g`` (:func:`fvx_models.attention.qat.fake_quantize`, shared with Attn-QAT, which uses
the one-level form). With ``x [M, K]`` the activations (every token of the call: one global scale) and ``W [N, K]``:

    forward   y = fq(x) fq(W)^T + b          (the NVFP4 GEMM, simulated in fp32 and cast to x's dtype)
    backward  dx = dy W,  dW = dy^T x,  db = sum dy     (full precision: the dense masters and activations)

No param or buffer is added: checkpoints and exports are those of the dense model. Which layers take it is the
family's curated set (``Family.architecture.linear_qat``: FastVideo's LTX-2 deployment set) or
``LinearQATConfig.modules``.
``implementation``: ``reference`` the PyTorch form above (any device), ``kernel`` flashinfer's real NVFP4 GEMM
(``mm_fp4``, CUDA with flashinfer installed; as FastVideo calls it), ``auto`` the kernel where it can run.
"""
from __future__ import annotations

import fnmatch
import functools
import importlib
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fvx.config import Config
from fvx_models.attention.qat import E2M1_MAX, E4M3_MAX, fake_quantize

GLOBAL_AMAX_FLOOR = 1e-12  # FastVideo's _global_sf clamps the tensor's amax here
FLASHINFER = "flashinfer"


class LinearQATConfig(Config):
    """NVFP4 quantization-aware training of a model's linear layers (module docstring): ``modules`` fnmatch patterns
    over module names (None: the family's curated set), ``implementation`` ``auto``, ``reference`` or ``kernel``."""

    format: Literal["nvfp4"] = "nvfp4"
    modules: tuple[str, ...] | None = None
    implementation: Literal["auto", "reference", "kernel"] = "auto"

    def __post_init__(self) -> None:
        if self.modules is not None and (not self.modules or not all(self.modules)):
            raise ValueError(f"linear_qat.modules must name at least one module pattern (or be None: the family's "
                             f"set), got {list(self.modules)}")


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """A tensor's NVFP4 global scale ``448 * 6 / max(amax, 1e-12)`` (fp32 scalar; NaNs ignored, as FastVideo's)."""
    amax = x.detach().float().abs().nan_to_num().amax().clamp(min=GLOBAL_AMAX_FLOOR)
    return (E4M3_MAX * E2M1_MAX) / amax


def fake_quantize_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """Two-level NVFP4 quantize-dequantize of ``x [..., K]`` in blocks of 16 along ``K`` (module docstring), fp32."""
    scale = global_scale(x)
    return fake_quantize(x.detach().float() * scale, dim=-1) / scale


class _NVFP4Linear(torch.autograd.Function):
    """``y = fq(x) fq(W)^T + b`` forward, full-precision backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        out = F.linear(fake_quantize_nvfp4(flat), fake_quantize_nvfp4(weight)).to(x.dtype)
        if bias is not None:
            out = out + bias.to(x.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (grad @ weight.to(grad.dtype)).view(x.shape)
        grad_w = (grad.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        grad_b = grad.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference NVFP4 QAT linear: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]`` in x's dtype."""
    return _NVFP4Linear.apply(x, weight, bias)


@functools.cache
def kernel_available() -> str | None:
    """None if flashinfer's NVFP4 GEMM can run here, else one line why (asked once a process: forwards ask it)."""
    if not torch.cuda.is_available():
        return "no CUDA device (flashinfer's mm_fp4 is a CUDA kernel)"
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        return f"NVFP4 GEMMs need sm_100 or newer; this device is sm_{major}{minor}"
    try:
        importlib.import_module(FLASHINFER)
    except Exception as error:  # a probe: any failure to import is a reason
        detail = str(error).splitlines()[0] if str(error) else ""
        return f"{FLASHINFER} is not importable ({type(error).__name__}: {detail})"
    return None


class _NVFP4LinearKernel(torch.autograd.Function):
    """The forward through flashinfer's NVFP4 quantizer and ``mm_fp4`` (bf16 activations, cutlass, 128x4 scale
    layout, as FastVideo's ``_LinearFWD4BWD16Fn``); the same full-precision backward as the reference."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        flashinfer = importlib.import_module(FLASHINFER)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        act = x if x.dtype in (torch.float16, torch.bfloat16) else x.to(torch.bfloat16)
        flat = act.reshape(-1, act.shape[-1]).contiguous()
        w = weight.to(act.dtype)
        layout = flashinfer.SfLayout.layout_128x4
        scale_x, scale_w = global_scale(flat), global_scale(w)
        x_fp4, x_sf = flashinfer.nvfp4_quantize(flat, scale_x, sfLayout=layout, do_shuffle=False)
        w_fp4, w_sf = flashinfer.nvfp4_quantize(w, scale_w, sfLayout=layout, do_shuffle=False)
        out = torch.empty(flat.shape[0], w.shape[0], device=x.device, dtype=act.dtype)
        flashinfer.mm_fp4(x_fp4, w_fp4.T, x_sf, w_sf.T, 1.0 / (scale_x * scale_w), act.dtype, out, block_size=16,
                          use_8x4_sf_layout=False, backend="cutlass")
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.view(*x.shape[:-1], w.shape[0]).to(x.dtype)

    backward = staticmethod(_NVFP4Linear.backward)


def nvfp4_linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`nvfp4_linear` on flashinfer's real NVFP4 GEMM; an ImportError (one line) where it cannot run."""
    why = kernel_available()
    if why is not None:
        raise ImportError(f"flashinfer's NVFP4 GEMM is not available here: {why}")
    return _NVFP4LinearKernel.apply(x, weight, bias)


class QATLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is NVFP4 QAT's (its class swapped in place by :func:`install`: same params)."""

    linear_qat_implementation: str = "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.linear_qat_implementation
        if choice == "auto":
            choice = "kernel" if x.device.type == "cuda" and kernel_available() is None else "reference"
        kernel = nvfp4_linear_kernel if choice == "kernel" else nvfp4_linear
        return kernel(x, self.weight, self.bias)


# ---------------------------------------------------------------------------------------------------- the skeleton


def patterns(config: LinearQATConfig, family: Any) -> tuple[str, ...]:
    """The module patterns ``config`` quantizes: its own, else the family's curated set."""
    return family.architecture.linear_qat if config.modules is None else config.modules


def refusal(config: LinearQATConfig, family: Any, module: nn.Module) -> str | None:
    """Why ``config`` cannot run on this skeleton (no curated set and none named, or a pattern matching no linear
    layer: one line naming it and some of the layers it has), or None."""
    chosen = patterns(config, family)
    if not chosen:
        return (f"linear_qat: the {family.name} family has no curated NVFP4 linear set; name the layers with "
                "linear_qat.modules (fnmatch patterns over module names)")
    linears = [name for name, part in module.named_modules() if isinstance(part, nn.Linear)]
    for pattern in chosen:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
            examples = dict.fromkeys(".".join("*" if piece.isdigit() else piece for piece in name.split("."))
                                     for name in linears)
            return (f"linear_qat.modules: {pattern!r} matches no linear layer of the {family.name} family; some of "
                    f"its layers: {', '.join(list(examples)[:10])}")
    return None


def targets(config: LinearQATConfig, family: Any, module: nn.Module) -> tuple[str, ...]:
    """The names of the linear layers ``config`` quantizes on this skeleton."""
    chosen = patterns(config, family)
    return tuple(name for name, part in module.named_modules()
                 if isinstance(part, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in chosen))


def check(config: LinearQATConfig | None, family: Any, module: nn.Module, who: str) -> None:
    """A ValueError (one line, ``who`` the model) when ``config`` cannot run here; before any weight loads."""
    if config is None:
        return
    why = refusal(config, family, module)
    if why is not None:
        raise ValueError(f"{who}: {why}")
    if config.implementation == "kernel" and kernel_available() is not None:
        raise ValueError(f"{who} linear_qat.implementation=kernel: {kernel_available()}")


def install(config: LinearQATConfig, family: Any, module: nn.Module) -> tuple[str, ...]:
    """Make the chosen linear layers of the skeleton :class:`QATLinear` (in place: no param added); their names."""
    names = targets(config, family, module)
    for name in names:
        layer = module.get_submodule(name)
        layer.__class__ = _qat_class(type(layer))
        layer.linear_qat_implementation = config.implementation
    return names


@functools.cache
def _qat_class(base: type) -> type:
    """``QATLinear`` for a plain ``nn.Linear``; for a subclass, one that keeps its type (and name) and takes the
    QAT forward."""
    if base is nn.Linear or issubclass(base, QATLinear):
        return QATLinear if base is nn.Linear else base
    return type(f"QAT{base.__name__}", (QATLinear, base), {"forward": QATLinear.forward})
