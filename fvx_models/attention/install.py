"""A model's attention kernel, installed on its attention modules as torchtitan applies a kernel: a plain function
applied to the skeleton, the same for every family.

A family's attention goes through diffusers' attention dispatcher, whose native backend calls PyTorch's
``scaled_dot_product_attention`` (fvx's sequence-parallel and block-causal processors dispatch the same way), or calls
``torch.nn.functional.scaled_dot_product_attention`` itself (the older processors: CogVideoX's, Latte's, Allegro's,
HunyuanVideo's token refiner). The first model built with another kernel routes both through one function
(:func:`route_attention`) that answers with the kernel of the attention call in progress (:data:`ROUTE`), else calls
the original: each attention module's processor is wrapped to set ``ROUTE`` for the duration of its call
(:class:`KernelProcessor`), so
the processor's own projections, norms, RoPE and all-to-alls are unchanged, and ``torch.compile`` traces it all
(a ``TorchFunctionMode`` would not: it cannot trace Tensor methods written in Python through one). Plain
kernels and ``qat`` run in every attention module (self and cross: forward-mode derivatives need every call in
``math``, and FastVideo's Attn-QAT backend quantizes each layer that takes it), ``qat`` only in those of
``Family.architecture.qat_attention`` where the family names them (LTX-2: FastVideo keeps its audio and masked text
attention dense); ``vsa`` and ``sla`` in the family's self-attention over the video tokens
(``Family.architecture.self_attention``), the others staying SDPA.
``vsa`` adds a zero-initialised gate projection ``to_gate_compress`` beside each self-attention module (on its block,
where FastVideo's Wan keeps it): a dense checkpoint loads without it (zeros) and starts as itself.
``sla`` adds its linear part's projection ``proj_l`` (Linear(head dim, head dim)) inside each self-attention module as
``attn_impl.proj_l``: ``blocks.N.attn1.attn_impl.proj_l.{weight,bias}``, the names FastVideo's TurboDiffusion
converter gives TurboWan's (``scripts/checkpoint_conversion/convert_turbodiffusion_to_diffusers.py``: TurboDiffusion's
``blocks.N.self_attn.attn_op.local_attn.proj_l``), so a TurboWan folder loads it and an export writes it back under
them. A dense checkpoint loads without it: zeros, as FastVideo initialises it (and fills it when a folder lacks it,
``fsdp_load.py``'s ``ALLOWED_NEW_PARAM_PATTERNS``); such a model computes the block-sparse part alone, which is not
dense attention (``fvx_models.attention.sla``).

What a kernel reads beyond SDPA's inputs lives in a :class:`Runtime`, one per built model: the token grid of the
running forward (set by ``fvx_models.build.apply``), VSA's sparsity (the target; a step's scheduled value inside
:meth:`Runtime.step`; 0 in a dense view) and whether a training step is running (QAT's validation form outside).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fvx_models.attention import kernels, qat, sla, vsa

GATE = "to_gate_compress"
SLA_MODULE = "attn_impl"  # the submodule of a self-attention that holds SLA's proj_l (FastVideo's name)
SLA_PROJECTION = f"{SLA_MODULE}.proj_l"


@dataclasses.dataclass
class Runtime:
    """What the installed kernel reads during a call (module docstring): set around calls, never by the kernels."""

    name: str
    schedule: Callable[[int], float] = lambda step: 0.0
    target: float = 0.0
    grid: tuple[int, int, int] | None = None
    sparsity: float = 0.0
    in_step: bool = False

    def __post_init__(self) -> None:
        self.sparsity = self.target

    def __deepcopy__(self, memo: dict) -> Runtime:
        """Itself: the skeleton and the unit templates ``compile="blocks"`` copies from it read one runtime."""
        return self

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[float | None]:
        """A training step ``step``: VSA at its scheduled sparsity (yielded; None for other kernels), QAT in its
        training form."""
        saved = self.sparsity, self.in_step
        self.sparsity, self.in_step = self.schedule(step), True
        try:
            yield self.sparsity if self.name == "vsa" else None
        finally:
            self.sparsity, self.in_step = saved

    @contextlib.contextmanager
    def dense(self) -> Iterator[None]:
        """VSA's dense view (sparsity 0, the gate kept), as FastVideo's critic and teacher see a VSA model."""
        saved, self.sparsity = self.sparsity, 0.0
        try:
            yield
        finally:
            self.sparsity = saved


class Route:
    """The kernel answering diffusers' native attention backend during one attention call (None: diffusers' own):
    a dynamic binding, as torch's grad mode is, set only by :class:`KernelProcessor` around its processor's call."""

    kernel: Callable[..., torch.Tensor] | None = None

    def __init__(self) -> None:
        self.kernel = None  # an instance attribute from the start: the first call's guards hold for every later one


ROUTE = Route()


def answer(kernel: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           **kwargs: Any) -> torch.Tensor:
    """``kernel`` on SDPA's arguments and layout, with ``ROUTE`` cleared meanwhile: a kernel that calls SDPA itself
    (a dispatcher backend's) reaches the original."""
    ROUTE.kernel = None
    try:
        return kernel(query, key, value, **kwargs)
    finally:
        ROUTE.kernel = kernel


def route_attention() -> None:
    """Make diffusers' native attention backend and ``torch.nn.functional.scaled_dot_product_attention`` answer with
    ``ROUTE.kernel`` when one is set (idempotent; a call with none set runs the original, unchanged)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    native = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]
    if not getattr(native, "routed_by_fvx", False):
        def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                   return_lse=False, _parallel_config=None):
            """diffusers' native backend (``[B, L, H, D]`` in and out), or the routed kernel (SDPA's layout)."""
            kernel = ROUTE.kernel
            if kernel is None or return_lse or _parallel_config is not None:
                return native(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                              _parallel_config=_parallel_config)
            if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
                attn_mask = attn_mask[:, None, None, :]  # [B, Lk] -> [B, 1, 1, Lk], as diffusers' own backend does
            out = answer(kernel, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                         attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
            return out.transpose(1, 2)
        routed.routed_by_fvx = True
        _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE] = routed
    original = torch.nn.functional.scaled_dot_product_attention
    if not getattr(original, "routed_by_fvx", False):
        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
            """torch's SDPA, or the routed kernel."""
            kernel = ROUTE.kernel
            if kernel is None:
                return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                scale=scale, enable_gqa=enable_gqa)
            return answer(kernel, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
        scaled_dot_product_attention.routed_by_fvx = True
        torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention


class KernelProcessor:
    """A family's attention processor run with its attention answered by ``kernel_for(attn, hidden_states)``."""

    def __init__(self, inner: Any, kernel_for: Callable[[nn.Module, torch.Tensor], Callable]) -> None:
        self.inner, self.kernel_for = inner, kernel_for

    def run(self, attn: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> Any:
        saved, ROUTE.kernel = ROUTE.kernel, self.kernel_for(attn, hidden_states)
        try:
            return self.inner(attn, hidden_states, *args, **kwargs)
        finally:
            ROUTE.kernel = saved


def wrapped(inner: Any, kernel_for: Callable[[nn.Module, torch.Tensor], Callable]) -> KernelProcessor:
    """``inner`` wrapped; its ``__call__`` keeps the inner signature (through ``__wrapped__``: a precomputed
    ``__signature__`` is a mappingproxy dynamo refuses after a dict mutation), which diffusers reads to filter
    arguments."""
    @functools.wraps(type(inner).__call__)
    def call(self, *args, **kwargs):
        return self.run(*args, **kwargs)
    cls = type(f"Kernel{type(inner).__name__}", (KernelProcessor,), {"__call__": call})
    return cls(inner, kernel_for)


# ---------------------------------------------------------------------------------------------------------- checks


def self_attention_modules(config: Any, module: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of each self-attention of the skeleton (the family's ``self_attention`` patterns)."""
    patterns = config.family.architecture.self_attention
    return {name: part for name, part in module.named_modules()
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)}


def attention_modules(module: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every attention module of the skeleton (diffusers' attention classes: a callable processor;
    Mochi's has no ``set_processor``)."""
    return {name: part for name, part in module.named_modules() if callable(getattr(part, "processor", None))}


def refusal(config: Any, sequence_parallel: bool = False) -> str | None:
    """Why ``config.attention`` cannot be installed on this family's preset, or None: ``vsa`` and ``sla`` need the
    family's self-attention over the video tokens alone (unmasked, one sequence) and no sequence parallelism, ``sla``
    the kernel's sizes when ``sla.implementation=kernel``."""
    family, name = config.family, config.attention
    if name not in ("vsa", "sla"):
        return None
    who, kernel = f"attention={name}: the {family.name} family", name.upper()
    if not family.architecture.self_attention:
        return f"{who} declares no self-attention over the video tokens to run {kernel} on"
    if family.architecture.vsa_refusal is not None:
        return f"{who} cannot run {kernel}{' (nor VSA)' if name == 'sla' else ''}: {family.architecture.vsa_refusal}"
    if sequence_parallel:
        return f"attention={name}: fvx runs {kernel} without sequence parallelism; run with --sp 1"
    head_dim = config.spec.kwargs.get("attention_head_dim")  # a preset without one: the kernel checks at its call
    if name == "sla" and config.sla.implementation == "kernel" and head_dim is not None:
        why = sla.kernel_refusal(int(head_dim), config.sla.block_q, config.sla.block_k)
        if why is not None:
            return f"attention=sla sla.implementation=kernel on {family.name}:{config.preset}: {why}"
    return None


def sla_head_dim(attn: nn.Module) -> int:
    """The head dim of a self-attention module: its query projection's width over its heads."""
    query = attn.to_q if hasattr(attn, "to_q") else attn.to_query
    heads = getattr(attn, "heads", None) or getattr(attn, "num_heads")
    return query.out_features // heads


# --------------------------------------------------------------------------------------------------------- install


def add_gates(config: Any, module: nn.Module) -> None:
    """``vsa``: a ``to_gate_compress`` Linear(dim, dim) on each self-attention's block (on meta, like the skeleton)."""
    for name, attn in self_attention_modules(config, module).items():
        block = module.get_submodule(name.rpartition(".")[0])
        query = attn.to_q if hasattr(attn, "to_q") else attn.to_query
        block.add_module(GATE, nn.Linear(query.in_features, query.out_features, device="meta"))


def add_sla_params(config: Any, module: nn.Module) -> None:
    """``sla``: ``attn_impl.proj_l``, a Linear(head dim, head dim), inside each self-attention (on meta, like the
    skeleton; module docstring)."""
    for attn in self_attention_modules(config, module).values():
        dim = sla_head_dim(attn)
        holder = nn.Module()
        holder.add_module("proj_l", nn.Linear(dim, dim, device="meta"))
        attn.add_module(SLA_MODULE, holder)


def zero_gates(module: nn.Module) -> dict[str, Callable[[Any], torch.Tensor]]:
    """The skeleton's zero-initialised attention params -> their zeros, whatever the other params: VSA's gates
    (:func:`add_gates`; a dense model starts as itself) and SLA's ``proj_l`` (:func:`add_sla_params`; FastVideo's
    init). A dense folder lacks them; a folder that has them (FastWan's gates, TurboWan's ``proj_l``) gives its own."""
    return {name: functools.partial(_zeros, tuple(p.shape)) for name, p in module.named_parameters()
            if f".{GATE}." in name or f".{SLA_PROJECTION}." in name}


def _zeros(shape: tuple[int, ...], params: Any) -> torch.Tensor:
    return torch.zeros(shape)


def install(config: Any, module: nn.Module) -> Runtime:
    """Wrap the skeleton's attention processors with ``config.attention``'s kernel (module docstring; after sequence
    parallelism's processors, before units are routed); the returned runtime is what those kernels read."""
    name = config.attention
    runtime = Runtime(name, schedule=functools.partial(_scheduled, config.vsa), target=config.vsa.sparsity) \
        if name == "vsa" else Runtime(name)
    if name == "sdpa":
        return runtime
    route_attention()
    targets = self_attention_modules(config, module) if name in ("vsa", "sla") else attention_modules(module)
    if name == "qat" and config.family.architecture.qat_attention is not None:
        targets = {path: attn for path, attn in targets.items()
                   if any(fnmatch.fnmatchcase(path, pattern) for pattern in config.family.architecture.qat_attention)}
    for path, attn in targets.items():
        gate = module.get_submodule(path.rpartition(".")[0]).get_submodule(GATE) if name == "vsa" else None
        processor = wrapped(attn.processor, functools.partial(_kernel_for, config, runtime, gate))
        if hasattr(attn, "set_processor"):
            attn.set_processor(processor)
        else:
            attn.processor = processor
    return runtime


def _scheduled(vsa_config: Any, step: int) -> float:
    return vsa.sparsity_at(int(step), vsa_config.sparsity, vsa_config.decay_rate, vsa_config.decay_interval_steps)


def _kernel_for(config: Any, runtime: Runtime, gate: nn.Module | None, attn: nn.Module,
                hidden_states: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The SDPA-shaped kernel of this call."""
    name = config.attention
    if name == "vsa":
        return functools.partial(_sparse, config, runtime, gate(hidden_states))
    if name == "qat":
        return functools.partial(_quantized, config, runtime)
    if name == "sla":
        return functools.partial(_sparse_linear, config, attn.get_submodule(SLA_PROJECTION))
    return kernels.plain(name)


def _sparse(config: Any, runtime: Runtime, gate: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
            scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """VSA over this forward's token grid; the gate ``[B, L, dim]`` split into the query's heads."""
    if attn_mask is not None or is_causal or dropout_p:
        raise ValueError(f"{config.family.name}: attention=vsa takes unmasked self-attention (a mask was given)")
    tokens = query.shape[-2]
    if runtime.grid is None or tokens != runtime.grid[0] * runtime.grid[1] * runtime.grid[2]:
        raise ValueError(f"{config.family.name}: attention=vsa: the self-attention runs over {tokens} tokens, not "
                         f"the video grid {runtime.grid}")
    heads = query.shape[1]
    gate = gate.unflatten(-1, (heads, -1)).transpose(1, 2).to(query.dtype)
    return vsa.sparse_attention(query, key, value, runtime.grid, runtime.sparsity, gate=gate, scale=scale,
                                implementation=vsa_implementation(config.vsa.implementation, query.device))


def _sparse_linear(config: Any, projection: nn.Linear, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """SLA of this self-attention call with its ``proj_l`` (``projection``, the call's own params)."""
    who = f"{config.family.name}: attention=sla"
    if attn_mask is not None or is_causal or dropout_p:
        raise ValueError(f"{who} takes unmasked self-attention (a mask, causal flag or dropout was given)")
    knobs = config.sla
    tokens, blocks = query.shape[-2], -(-query.shape[-2] // knobs.block_k)
    if sla.topk_count(knobs.topk_ratio, blocks) < 1:
        raise ValueError(f"{who}: the self-attention runs over {tokens} tokens, {blocks} key blocks of "
                         f"sla.block_k={knobs.block_k}, and sla.topk_ratio={knobs.topk_ratio} keeps "
                         f"int({knobs.topk_ratio} * {blocks}) = 0 of them; use larger clips, a smaller sla.block_k "
                         f"or a larger sla.topk_ratio")
    implementation = sla_implementation(knobs.implementation, query, knobs.block_q, knobs.block_k, scale)
    return sla.sparse_linear_attention(query, key, value, projection, topk_ratio=knobs.topk_ratio,
                                       block_q=knobs.block_q, block_k=knobs.block_k, feature_map=knobs.feature_map,
                                       scale=scale, implementation=implementation)


def _quantized(config: Any, runtime: Runtime, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """Fake-quantized attention (a training step, or validation in its training form), or the inference kernel."""
    if dropout_p or is_causal:
        raise ValueError(f"{config.family.name}: attention=qat takes no dropout or causal flag")
    if config.qat.validation == "infer" and not runtime.in_step:
        return qat.qat_attention_infer(query, key, value, scale=scale)
    if qat_implementation(config.qat.implementation, query.device) == "kernel":
        if attn_mask is not None:
            raise ValueError(f"{config.family.name}: qat.implementation=kernel takes no attention mask")
        return qat.qat_attention_kernel(query, key, value, scale=scale)
    return qat.qat_attention(query, key, value, attn_mask=attn_mask, scale=scale)


def vsa_implementation(choice: str, device: torch.device) -> str:
    """``auto`` -> the CUDA kernel when installed and the tensors are on a GPU, else the reference."""
    if choice != "auto":
        return choice
    return "kernel" if device.type == "cuda" and vsa.kernel_available() is None else "reference"


def sla_implementation(choice: str, query: torch.Tensor, block_q: int, block_k: int, scale: float | None) -> str:
    """``auto`` -> the Triton kernel when installed, the tensors are on a GPU and it takes these sizes, else the
    reference."""
    if choice != "auto":
        return choice
    usable = (query.device.type == "cuda" and sla.kernel_available() is None
              and sla.kernel_refusal(query.shape[-1], block_q, block_k, scale) is None)
    return "kernel" if usable else "reference"


def qat_implementation(choice: str, device: torch.device) -> str:
    """``auto`` -> the Triton kernel when installed and the tensors are on a GPU, else the reference."""
    if choice != "auto":
        return choice
    return "kernel" if device.type == "cuda" and qat.kernel_available() is None else "reference"


def check(config: Any, who: str, sequence_parallel: bool = False) -> None:
    """A ValueError (one line, ``who`` the model) when the kernel cannot be installed on this family (:func:`refusal`)
    or is not usable here, or an implementation it asks for by name is not; before any weight loads."""
    why = refusal(config, sequence_parallel)
    if why is not None:
        raise ValueError(f"{who}: {why}")
    kernels.check(config.attention, f"{who} attention")
    if config.attention == "vsa" and config.vsa.implementation == "kernel" and vsa.kernel_available() is not None:
        raise ValueError(f"{who} vsa.implementation=kernel: {vsa.kernel_available()}")
    if config.attention == "sla" and config.sla.implementation == "kernel" and sla.kernel_available() is not None:
        raise ValueError(f"{who} sla.implementation=kernel: {sla.kernel_available()}")
    if config.attention == "qat":
        if config.qat.implementation == "kernel" and qat.kernel_available() is not None:
            raise ValueError(f"{who} qat.implementation=kernel: {qat.kernel_available()}")
        if config.qat.validation == "infer" and qat.infer_kernel_available() is not None:
            raise ValueError(f"{who} qat.validation=infer: {qat.infer_kernel_available()}; use qat.validation=train")
