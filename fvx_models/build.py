"""The generic builder: any family's spec (``fvx_models.family.Family``) and config -> the :class:`Model` methods see.

``ModelConfig`` holds the knobs every family shares: the preset, a local diffusers folder to start from, remat, the
compute dtype, how a frozen role is stored, and how units run (eagerly, or ``compile="blocks"``: one compiled function
per unit group). A family's config subclasses it (adding its own knobs) and names its spec in the class variable
``family``. :func:`build` applies, in order and the same way to every family: the meta skeleton, remat
(``fvx.core.grad.remat`` through diffusers' gradient checkpointing), sequence parallelism when the mesh has SP groups
(the family's ``architecture.sequence_parallel``), the unit groups, sharding over a device mesh (per-unit gathers in
the compute dtype), and compilation (``fvx.distributed.compile``), as torchtitan applies ``apply_ac``,
``apply_compile`` and ``apply_fsdp`` to any model. The :class:`Model` it returns is assembled one part at a time
(its weights, exports, rules and kernels).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import pathlib
from typing import Any, Callable, ClassVar, Hashable, Literal, Mapping

import torch
from torch import nn

from fvx.config import Config
from fvx.core import functional, grad as fvx_grad, role, tree
from fvx.distributed import compile as fvx_compile, gather_schedule, memory, processes, sharding
from fvx.distributed.gathers import sharded_call
from fvx_models import (cond as fcond, diffusers_folder as dfolder, layouts, linear_qat as flinear_qat, lora as flora,
                        lora_files, original_layout)
from fvx_models.attention import install as attention, kernels
from fvx_models.attention.config import QATConfig, SLAConfig, VSAConfig
from fvx_models.family import Family, init_params, Preset
from fvx_models.model import Exports, Kernels, Model, Params, Rules, Weights, Written

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The families whose configs can take a second time input r (they define their own ``two_time``, the family its
# ``with_r``), for the refusal of the others (tests/fvx_models/test_two_time_refusal.py checks it against every family)
TWO_TIME_FAMILIES = "wan (models.<name>.r_embedder={}: fvx_models.wan_two_time) or anyflow (fvx_models.anyflow)"


class ModelConfig(Config):
    """A model of some family: ``preset`` (an architecture of the family), ``path`` (a local diffusers pipeline root or
    component folder to start from; None: random init from the run's keys), ``remat`` (recompute each unit's activations
    in the backward), ``compute_dtype`` (params and activations are cast inside the call; masters stay fp32),
    ``frozen_dtype`` (how a role that never trains stores this model: bf16 halves a teacher, except the modules
    diffusers keeps in fp32), ``compile``: ``"none"`` runs units eagerly, ``"blocks"`` through one ``torch.compile``'d
    function per unit group, ``"model"`` the whole forward as one graph (one process only; longer to compile)
    (``compile_backend`` "inductor", or "aot_eager" to check numerics without codegen), ``reshard_after_forward`` (on a
    mesh: drop each unit's gathered params after its forward and gather them again in its backward, as FSDP2 does by
    default; False keeps every unit's full params from its forward to its backward, one all-gather per unit and step
    fewer; under remat the backward gathers again either way), and ``lora``: train low-rank adapters on a frozen base
    (``fvx_models.lora``; the base is stored in ``frozen_dtype``) instead of the params; ``linear_qat``: NVFP4
    quantization-aware training of the family's curated linear layers (``fvx_models.linear_qat``). ``attention``: the
    kernel of the model's attention (``fvx_models.attention``: ``sdpa``, ``math``, ``flex``, ``vsa`` with its ``vsa``
    knobs, ``qat`` with its ``qat`` knobs, ``sla`` with its ``sla`` knobs, or an installed kernel of diffusers'
    dispatcher), per model: roles that share a model share its code."""

    family: ClassVar[Family]

    preset: str = "tiny"
    path: str | None = None
    remat: bool = False
    compute_dtype: Literal["fp32", "bf16"] = "fp32"
    frozen_dtype: Literal["fp32", "bf16"] = "bf16"
    compile: fvx_compile.Mode = "none"
    compile_backend: str = "inductor"
    reshard_after_forward: bool = True
    lora: flora.LoRAConfig | None = None
    linear_qat: flinear_qat.LinearQATConfig | None = None
    attention: str = "sdpa"
    vsa: VSAConfig = VSAConfig()
    qat: QATConfig = QATConfig()
    sla: SLAConfig = SLAConfig()

    def __post_init__(self) -> None:
        self.family.preset(self.preset)
        kernels.check_known(self.attention)
        for knob, default in (("vsa", VSAConfig()), ("qat", QATConfig()), ("sla", SLAConfig())):
            if self.attention != knob and getattr(self, knob) != default:
                raise ValueError(f"{knob}.* knobs are set but attention={self.attention}; they apply to "
                                 f"attention={knob}")

    def field_choices(self) -> dict[str, list[str]]:
        """The values a text field takes, for ``--help``: the family's presets, the attention kernels usable here."""
        return {"preset": list(self.family.presets), "attention": list(kernels.usable())}

    @property
    def spec(self) -> Preset:
        return self.family.preset(self.preset)

    @property
    def two_time(self) -> bool:
        """Whether the model takes a second time ``r``: a flow map ``u(x_t, t, r)`` (``fvx_models.wan_two_time``)."""
        return False

    def frozen(self, name: str) -> bool:
        """Whether param ``name`` never trains under this config (a family may freeze a part, e.g. an expert)."""
        return False

    def build(self, *, mesh: Any = None) -> Model:
        """The :class:`Model` of this config: a skeleton built now, params sharded over ``mesh`` when given."""
        return build(self, mesh=mesh)

    def write_cond_file(self, path: str | pathlib.Path, batch: Mapping[str, Any], captions: list[str]) -> None:
        """A cond file (``fvx_models.cond``) of the family's text cond tensors made from a data ``batch`` (what
        ``encode-prompts`` writes; the image condition of an I2V family is left out, as negative-prompt files lack
        it), with the captions."""
        cond = self.family.conditioning.from_batch(self, batch)
        given = self.family.conditioning.image | set(self.family.conditioning.blank)
        fcond.save(path, {name: t for name, t in cond.items() if name not in given}, captions)


# ---------------------------------------------------------------------------------------------------------- pieces


def skeleton(config: ModelConfig) -> nn.Module:
    """The family's meta skeleton with remat installed when the config asks for it (effective only under grad)."""
    module = config.family.architecture.skeleton(config)
    if config.attention == "vsa":
        attention.add_gates(config, module)
    if config.attention == "sla":
        attention.add_sla_params(config, module)
    if config.remat:
        for part in module.modules():
            if getattr(part, "_supports_gradient_checkpointing", False):
                part.enable_gradient_checkpointing(fvx_grad.remat)
    return module


def sequence_parallel(config: ModelConfig, module: nn.Module, group: Any) -> None:
    """Install the family's sequence parallelism for ``group`` (an ``fvx.distributed.sequence_parallel.SPGroup``) on the
    skeleton, before its units are routed (so a compiled template carries it); a ValueError when the family has none
    or the preset does not split (its heads over the group)."""
    family = config.family
    if family.architecture.sequence_parallel is None:
        raise ValueError(f"{family.name}:{config.preset}: the {family.name} family has no sequence parallelism "
                         f"(--sp {group.size}); run it with --sp 1 (Wan and the block-causal Wan have it)")
    family.architecture.sequence_parallel(config, module, group)


def unit_groups(family: Family, module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Group name -> the unit prefixes of its ModuleLists (``"blocks.0."``, ...). A group whose units differ (Matrix-
    Game's blocks with and without an action module) splits by structure into ``name`` (the first unit's) and
    ``name[k]`` (:func:`family_group` maps them back to ``name``): a compiled unit function serves units of one
    structure."""
    groups = {}
    for name, paths in family.architecture.unit_groups.items():
        units = tuple(f"{path}.{i}." for path in paths for i in range(len(module.get_submodule(path))))
        kinds: dict[tuple, list[str]] = {}
        for unit in units:
            kinds.setdefault(fvx_compile.structure(module.get_submodule(unit[:-1])), []).append(unit)
        for k, members in enumerate(kinds.values()):
            groups[name if k == 0 else f"{name}[{k}]"] = tuple(members)
    return groups


def family_group(group: str) -> str:
    """The family's group of a unit group (``"blocks[1]"`` -> ``"blocks"``)."""
    return group.split("[", 1)[0]


def fp32_kept(module: nn.Module) -> frozenset[str]:
    """The params diffusers keeps in fp32 under a low-precision dtype (each component's ``_keep_in_fp32_modules``,
    matched against the parts of the param's name within that component, as diffusers does)."""
    kept = set()
    for prefix, part in module.named_modules():
        keep = getattr(type(part), "_keep_in_fp32_modules", None) or ()
        if not keep:
            continue
        start = f"{prefix}." if prefix else ""
        for name, _ in part.named_parameters():
            if any(piece in keep for piece in name.split(".")):
                kept.add(start + name)
    return frozenset(kept)


def dtypes_for(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Per param, the dtype it is stored or computed in under ``dtype``: fp32 for the params diffusers keeps in fp32."""
    kept = fp32_kept(module)
    return {name: torch.float32 if name in kept else dtype for name, _ in module.named_parameters()}


def export_dtypes(config: ModelConfig, module: nn.Module, trained: frozenset[str],
                  dtype: str | None) -> Callable[[str], torch.dtype | None]:
    """How an export stores each param: in ``dtype`` when given (but the params diffusers keeps in fp32); else the
    ``trained`` params as trained (fp32 masters) and the others (a LoRA's merged base, a frozen expert) in the dtype
    the base folder ``config.path`` stores them in (fp32 for a base the run drew)."""
    if dtype is not None:
        kept = fp32_kept(module)
        return lambda name: torch.float32 if name in kept else DTYPES[dtype]
    checkpoints = config.family.checkpoints
    stored = ({} if config.path is None else
              dfolder.stored_dtypes(config.path, module, checkpoints.components, f"{config.family.name} export",
                                    checkpoints.stored_names))
    return lambda name: None if name in trained else stored.get(name)


def place(params: Params, *, mesh: Any, layout: sharding.Layout | None,
          dtypes: Mapping[str, torch.dtype] | None = None) -> Params:
    """Whole params as the step takes them: this rank's ``Shards`` on ``mesh`` (in ``dtypes``), or cast."""
    if mesh is not None:
        return sharding.shard(params, mesh, layout=layout, dtype=dtypes)
    if dtypes is None:
        return params
    return {name: p.to(dtypes[name]) for name, p in params.items()}


def _check_inputs(who: str, config: ModelConfig, spec: fcond.Spec, x_t: Any, t: Any, cond: Any) -> None:
    modalities = config.family.trained(config)
    if len(modalities) > 1:
        _check_joint(who, config, modalities, x_t, t)
        x_t, t = x_t["video"], t["video"]
    preset = config.spec
    channels, patch = preset.latents.channels, _patch(config)
    if not (isinstance(x_t, torch.Tensor) and x_t.dim() == 5 and x_t.shape[1] == channels
            and all(size % p == 0 for size, p in zip(x_t.shape[2:], patch))):
        got = tuple(x_t.shape) if isinstance(x_t, torch.Tensor) else type(x_t).__name__
        raise ValueError(f"{who} apply: x_t must be [B, {channels}, T, H, W] with T, H, W divisible by {patch}, "
                         f"got {got}")
    batch, frames = x_t.shape[0], x_t.shape[2] // patch[0]
    shapes = [(batch,), (batch, frames)] if config.family.forward.per_frame_timesteps else [(batch,)]
    if not (isinstance(t, torch.Tensor) and tuple(t.shape) in shapes):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        what = "one timestep per sample" + (f", or [{batch}, {frames}]: one per latent frame" if len(shapes) > 1 else "")
        raise ValueError(f"{who} apply: t must be a tensor of shape [{batch}] ({what}), got {got}")
    fcond.check(cond, spec, who, batch=batch)


def _check_joint(who: str, config: ModelConfig, modalities: tuple[str, ...], x_t: Any, t: Any) -> None:
    """A ValueError unless a joint model's ``x_t`` and ``t`` are dicts keyed by its modalities, each modality's
    latents ``[B, C, ...]`` of its channels and ``t`` ``[B]`` each."""
    for name, value in (("x_t", x_t), ("t", t)):
        if not (isinstance(value, Mapping) and set(value) == set(modalities)):
            got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"{who} apply: {name} of a joint model must be a dict keyed by {list(modalities)}, "
                             f"got {got}")
    batch = x_t["video"].shape[0] if isinstance(x_t["video"], torch.Tensor) else None
    for modality in modalities[1:]:
        latents, channels = x_t[modality], config.family.joint.modalities[modality].latents(config).channels
        if not (isinstance(latents, torch.Tensor) and latents.dim() >= 3 and latents.shape[0] == batch
                and latents.shape[1] == channels):
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"{who} apply: x_t[{modality!r}] must be [{batch}, {channels}, ...], got {got}")
        if not (isinstance(t[modality], torch.Tensor) and tuple(t[modality].shape) == (batch,)):
            raise ValueError(f"{who} apply: t[{modality!r}] must be a tensor of shape [{batch}]")


def _patch(config: ModelConfig) -> tuple[int, int, int]:
    if config.family.architecture.patch is not None:
        return config.family.architecture.patch(config)
    kwargs = config.spec.kwargs
    patch = kwargs.get("patch_size")
    if isinstance(patch, int):  # HunyuanVideo: spatial patch_size and patch_size_t (CogVideoX 1.0's None: 1)
        return (kwargs.get("patch_size_t") or 1, patch, patch)
    return tuple(patch)


# ----------------------------------------------------------------------------------------------------------- apply


def apply(config: ModelConfig, module: nn.Module, spec: fcond.Spec, params: Params, x_t: torch.Tensor,
          t: torch.Tensor, cond: Mapping[str, torch.Tensor], *, compute_dtypes: Mapping[str, torch.dtype] | None,
          gathers: gather_schedule.UnitGathers | None, runtime: attention.Runtime, dense: bool = False,
          forward: Callable | None = None, call: Any = None, r: torch.Tensor | None = None) -> torch.Tensor:
    """Flow velocity fp32 ``[B, C, T, H, W]`` of latents ``x_t [B, C, T, H, W]`` at ``t [B]`` (0..1000) under
    ``cond``. Under a compute dtype, params (but the fp32-kept) and the float inputs are cast inside the call;
    gradients reach the caller's params in their own dtype; ``t`` stays fp32 (bf16 cannot hold 999). Params may be
    stored lower than they compute in (a bf16 teacher under fp32 compute computes from its bf16-rounded weights).
    Sharded (``gathers``): ``params`` are this rank's shards and each unit gathers its own in the compute dtype.
    ``forward(params, buffers, kwargs)``: the compiled whole forward (``compile="model"``).
    ``call`` is bound to the skeleton for this forward by the family's ``forward.bind`` (a causal family's KV cache).
    ``r`` (shaped as ``t``): a two-time model's target time, the average velocity from ``t`` to ``r``; None: ``r =
    t``, the instantaneous velocity. ``runtime``: what the attention kernel reads (it learns this call's token grid);
    ``dense``: VSA's dense view. A family whose DiT takes one sample a call (``Training.one_sample``) runs a batch
    sample by sample, the velocities stacked."""
    family = config.family
    _check_inputs(family.name, config, spec, x_t, t, cond)
    size = (x_t["video"] if isinstance(x_t, Mapping) else x_t).shape[0]
    if family.training.one_sample is not None and size > 1:
        one = functools.partial(apply, config, module, spec, params, compute_dtypes=compute_dtypes, gathers=gathers,
                                runtime=runtime, dense=dense, forward=forward, call=call)
        return _stacked([one(*(role.rows(part, slice(i, i + 1)) for part in (x_t, t, cond)),
                             r=None if r is None else r[i:i + 1]) for i in range(size)])
    if r is not None and not config.two_time:
        raise ValueError(f"{family.name}:{config.preset} apply: r given to a model without a second time input")
    if r is not None and not (isinstance(r, torch.Tensor) and r.shape == t.shape):
        raise ValueError(f"{family.name} apply: r must have t's shape {tuple(t.shape)}, got "
                         f"{tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}")
    dtype = DTYPES[config.compute_dtype]
    x, t, cond = native(x_t, family.forward.layout, dtype), tree.map_tensors(_fp32, t), fcond.to(cond, dtype=dtype)
    kwargs = family.forward.inputs(config, x, t, cond, gathers is not None)
    if config.two_time:
        kwargs = family.forward.with_r(config, kwargs, x, t if r is None else r.to(torch.float32))
    video = x_t["video"] if isinstance(x_t, Mapping) else x_t
    buffers = {name: b.to(video.device) for name, b in functional.held(module)[1].items()}
    runtime.grid = tuple(size // p for size, p in zip(video.shape[2:], _patch(config)))
    with (contextlib.nullcontext() if family.forward.bind is None else family.forward.bind(module, call),
          runtime.dense() if dense else contextlib.nullcontext()):
        if gathers is not None:
            out = sharded_call(module, params, buffers, (), kwargs, gathers=gathers)
        else:  # a cast to a param's own dtype is free (the same tensor)
            params = {name: p.to(compute_dtypes[name]) for name, p in params.items()}
            out = (forward(params, buffers, kwargs) if forward is not None else
                   functional.call(module, params, buffers, (), kwargs))
    return velocity(config, out, x, t, cond)


def _stacked(rows: list[Any]) -> Any:
    """Per-sample velocities (tensors, or a joint model's dicts of them) stacked along the batch."""
    if isinstance(rows[0], Mapping):
        return {name: torch.cat([row[name] for row in rows]) for name in rows[0]}
    return torch.cat(rows)


def velocity(config: ModelConfig, out: Any, x: Any, t: Any, cond: Mapping[str, torch.Tensor]) -> Any:
    """The DiT's output ``out`` for the input ``x`` (in the family's layout) at ``t`` under ``cond`` as the fp32 flow
    velocity ``[B, C, T, H, W]``: the family's output conversion, then its layout undone (a joint model's: a dict
    keyed by modality, the video's layout undone)."""
    family = config.family
    v = family.forward.output(config, out, x, t, cond)
    if isinstance(v, Mapping):
        return {name: (layouts.to_canonical(part, family.forward.layout) if name == "video" else part).float()
                for name, part in v.items()}
    return layouts.to_canonical(v, family.forward.layout).float()


def native(x_t: Any, layout: str, dtype: torch.dtype | None = None) -> Any:
    """``x_t`` (``[B, C, T, H, W]``, or a joint model's dict keyed by modality) in the family's ``forward.layout`` (the
    video's; other modalities as they are), cast to ``dtype`` when given."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))  # noqa: E731
    if isinstance(x_t, Mapping):
        return {name: layouts.to_native(cast(x), layout) if name == "video" else cast(x) for name, x in x_t.items()}
    return layouts.to_native(cast(x_t), layout)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def native_inputs(config: ModelConfig, x_t: Any, t: Any,
                  cond: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], Any]:
    """The DiT's keyword arguments for ``(x_t, t, cond)`` as :func:`apply` makes them (unsharded, no casts; a
    two-time model's ``r`` is ``t``), and ``x_t`` in the family's layout (what :func:`velocity` takes): to call the
    diffusers module directly."""
    x = native(x_t, config.family.forward.layout)
    kwargs = config.family.forward.inputs(config, x, t, cond, False)
    return (config.family.forward.with_r(config, kwargs, x, t) if config.two_time else kwargs), x


def _check_whole_compile(config: ModelConfig, mesh: Any) -> None:
    """A ValueError unless ``compile="model"`` can run: one process, a family whose forward is one graph."""
    who = f"{config.family.name}:{config.preset}"
    if mesh is not None:
        raise ValueError(f"{who}: compile=model compiles the whole forward in one process only (sharded, with remat, "
                         "inductor gave wrong patch-embedding gradients on torch 2.13); use compile=blocks on a mesh")
    if config.family.architecture.whole_graph_refusal is not None:
        raise ValueError(f"{who}: compile=model cannot compile the {config.family.name} family's forward as one graph "
                         f"({config.family.architecture.whole_graph_refusal}); use compile=blocks")


def _forward_ad_refusal(config: ModelConfig) -> str | None:
    """Why the model has no forward-mode derivatives (its attention kernel's or linear QAT's), or None."""
    if config.attention not in kernels.FORWARD_AD:
        return f"attention={config.attention} has no forward-mode derivatives (math and sdpa have)"
    if config.linear_qat is not None:
        return "linear_qat has no forward-mode derivatives (its straight-through linear defines a backward only)"
    return None


# ----------------------------------------------------------------------------------------------------------- build


def build(config: ModelConfig, *, mesh: Any = None) -> Model:
    """The :class:`Model` of ``config`` (module docstring): every function bound to one skeleton built now. With
    ``config.lora`` the skeleton carries the adapters, and a copy without them (``plain``) reads and writes diffusers
    folders."""
    family, preset = config.family, config.spec
    who = f"{family.name}:{config.preset}"
    if config.compile == "model":
        _check_whole_compile(config, mesh)
    module, plain, adapted, runtime = _installed(config, mesh, who)
    groups = unit_groups(family, module)
    architecture = tuple(dfolder.param_shapes(plain))
    trained = _trained_names(config, architecture, adapted)
    compute_dtypes = dtypes_for(module, DTYPES[config.compute_dtype])
    layout = gathers = None
    if mesh is not None:
        group = processes.group_of(mesh)
        layout = sharding.plan(dfolder.param_shapes(module), group.shard_size)
        gathers = gather_schedule.UnitGathers(groups, layout, group, compute_dtypes,
                                              reshard_after_forward=config.reshard_after_forward, remat=config.remat)
    stats = whole_forward = None
    if config.compile == "model":
        stats = fvx_compile.CompileStats()
        whole_forward = fvx_compile.whole_function(module, stats, config.compile_backend)
    elif config.compile != "none" or layout is not None:
        stats = fvx_compile.install_units(module, groups, mode=config.compile, gather=gathers,
                                          backend=config.compile_backend)
    spec = dict(family.conditioning.spec(config))
    image = frozenset(family.conditioning.image & set(spec))
    weights = _weights(config, module, plain, adapted, architecture, trained, mesh, layout)
    modalities = family.trained(config)
    bound_apply = functools.partial(apply, config, module, spec, compute_dtypes=compute_dtypes, gathers=gathers,
                                    runtime=runtime, forward=whole_forward)
    return Model(
        name=who,
        latents=preset.latents,
        cond=spec,
        patch_size=_patch(config),
        apply=bound_apply,
        batch=functools.partial(_model_batch, config, spec),
        uncond=functools.partial(fcond.uncond, zero=family.conditioning.zero, kept=image,
                                 blank=family.conditioning.blank),
        load_cond=functools.partial(_load_cond, spec, family, image),
        memory_spec=functools.partial(_memory_spec, config, module, groups, weights, architecture),
        weights=weights,
        export=_exports(config, plain, adapted, architecture, trained),
        rules=_rules(config, modalities),
        kernels=Kernels(attention=config.attention, attention_step=runtime.step,
                        dense_apply=functools.partial(bound_apply, dense=True) if config.attention == "vsa" else None,
                        compile_stats=None if config.compile == "none" else stats),
        causal=None if family.forward.causal is None else family.forward.causal(config, bound_apply, module),
        modalities={} if len(modalities) == 1 else {
            name: preset.latents if name == "video" else family.joint.modalities[name].latents(config)
            for name in modalities},
        window_cond=(None if family.conditioning.window is None
                     else functools.partial(family.conditioning.window, config)),
        lead_frames=family.forward.lead_frames,
    )


def _installed(config: ModelConfig, mesh: Any, who: str) -> tuple[nn.Module, nn.Module, tuple, attention.Runtime]:
    """The skeleton as it runs (``module``: LoRA adapters, sequence parallelism on the mesh's SP groups, the attention
    kernel and linear QAT installed), the ``plain`` architecture (``module`` itself without adapters), the adapted
    modules and the attention runtime."""
    family = config.family
    sequence = processes.sequence_group(mesh)
    attention.check(config, who, sequence_parallel=sequence is not None)
    module = skeleton(config)
    plain, adapted = module, ()
    if config.lora is not None:
        plain = copy.deepcopy(module)
        untrained = functools.partial(_owner_untrained, family, family.trained(config))
        held = family.training.held_frozen(config)  # never trained: no adapters either
        adapted = flora.install(module, config.lora, who,
                                lambda name: config.frozen(name) or untrained(name) or name in held)
    if sequence is not None:
        sequence_parallel(config, module, sequence)
    runtime = attention.install(config, module)
    flinear_qat.check(config.linear_qat, family, module, who)
    if config.linear_qat is not None:
        flinear_qat.install(config.linear_qat, family, module)
    return module, plain, adapted, runtime


def _trained_names(config: ModelConfig, architecture: tuple[str, ...], adapted: tuple) -> frozenset[str]:
    """What a role of the model trains: its adapters, else every param but those the config freezes, the family
    holds frozen and the branches of modalities it does not train."""
    if adapted:
        return frozenset(flora.adapter_names(adapted))
    family, modalities = config.family, config.family.trained(config)
    held = family.training.held_frozen(config) | {name for name in architecture
                                                  if _owner_untrained(family, modalities, name)}
    return frozenset(name for name in architecture if not (config.frozen(name) or name in held))


def _weights(config: ModelConfig, module: nn.Module, plain: nn.Module, adapted: tuple, architecture: tuple[str, ...],
             trained: frozenset[str], mesh: Any, layout: sharding.Layout | None) -> Weights:
    """The model's :class:`Weights`: drawn from keys or read from folders (the ``plain`` architecture's; adapters
    drawn on ``module``'s), placed on ``mesh``."""
    family = config.family
    placed = functools.partial(place, mesh=mesh, layout=layout)
    derived = {**family.architecture.derived(config), **attention.zero_gates(plain)}
    held = tuple(name for name in architecture if name not in trained)  # what a trained role holds frozen

    def drawn(key: torch.Tensor) -> Params:
        params = init_params(plain, key, family.architecture.init_rules, family.name)
        return {**params, **{name: make(params) for name, make in derived.items()}}

    def read(folder: str) -> Params:
        return dfolder.read_params(folder, plain, family.checkpoints.components, f"{family.name} load",
                                   lazy=mesh is not None, derived=derived,
                                   stored_names=family.checkpoints.stored_names)

    def whole(key: torch.Tensor) -> Params:
        """The architecture's fp32 params: read from ``config.path`` (on a mesh as handles each rank reads its
        slices of), else drawn from ``key``."""
        return drawn(key) if config.path is None else read(config.path)

    def initial(key: torch.Tensor) -> Params:
        if adapted:
            return placed(flora.init_adapters(module, adapted, key, config.lora))
        full = whole(key)
        return placed({name: full[name] for name in architecture if name in trained})

    def base(key: torch.Tensor, *, whole_model: bool = False) -> Params:
        names = architecture if whole_model else held
        if not names:
            return {}
        full = whole(key)
        params = placed({name: full[name] for name in names}, dtypes=dtypes_for(plain, DTYPES[config.frozen_dtype]))
        return tree.map_tensors(torch.Tensor.detach, params)

    def base_id(*, whole_model: bool = False) -> Hashable | None:
        names = architecture if whole_model else held
        if not names:
            return None
        part = "all" if len(names) == len(architecture) else frozenset(names)
        return (family.name, config.preset, config.path, config.frozen_dtype, mesh is None, part)

    return Weights(init=lambda key: placed(drawn(key)), load=lambda folder: placed(read(folder)), initial=initial,
                   base=base, base_id=base_id, trained_names=trained, layout=layout)


def _exports(config: ModelConfig, plain: nn.Module, adapted: tuple, architecture: tuple[str, ...],
             trained: frozenset[str]) -> Exports:
    """The model's :class:`Exports`: whole folders (adapters merged) and a LoRA model's adapter files."""
    family = config.family

    def folder(params: Params, folder: str, *, form: str = "diffusers", dtype: str | None = None,
               stem: str | None = None) -> Written:
        if adapted:
            params = flora.merged({name: params[name] for name in architecture}, params, adapted, config.lora.scale)
        dtype_of = export_dtypes(config, plain, trained, dtype)
        what = f"{family.name} export"
        stored = tuple(sorted({str(dtype_of(name) or p.dtype).removeprefix("torch.") for name, p in params.items()}))
        if form == "comfyui":
            return original_layout.write(params, folder, family, what, dtype_of=dtype_of, stem=stem)._replace(
                dtypes=stored)
        checkpoints = family.checkpoints
        pipeline = (None if checkpoints.pipeline_files is None
                    else functools.partial(checkpoints.pipeline_files, config))
        dfolder.write_folder(params, folder, plain, checkpoints.components, what, dtype_of=dtype_of,
                             pipeline_files=pipeline)
        return Written({component: pathlib.Path(folder) / component for component in checkpoints.components},
                       dtypes=stored)

    return Exports(
        folder=folder,
        adapters=None if config.lora is None else functools.partial(
            lora_files.write, flora.Adapters(config.lora, adapted, family)),
        formats=("diffusers",) + (("comfyui",) if family.checkpoints.original_name is not None
                                  and "comfyui" in family.checkpoints.original_formats else ()),
        adapter_formats=() if config.lora is None else lora_files.formats(family))


def _rules(config: ModelConfig, modalities: tuple[str, ...]) -> Rules:
    """The model's :class:`Rules`: the family's training rules bound to ``config``, and what the model refuses."""
    family, training = config.family, config.family.training
    return Rules(
        sigma_sampler=None if training.sigma_sampler is None else functools.partial(training.sigma_sampler, config),
        step_ranges=training.step_ranges(config),
        joint_sigmas=None if len(modalities) == 1 else functools.partial(_joint_sigmas, config, modalities),
        latent_rule=functools.partial(training.latent_rule, config),
        cfg_dropout_refusal=family.conditioning.cfg_dropout_refusal,
        two_time=config.two_time,
        two_time_refusal=None if type(config).two_time is not ModelConfig.two_time else
        f"the {family.name} family takes no second time input; a flow map trains on a two-time family: "
        f"{TWO_TIME_FAMILIES}",
        forward_ad_refusal=_forward_ad_refusal(config),
        loss_weight=None if training.loss_weight is None else functools.partial(training.loss_weight, config),
        sampling_sigmas=(None if training.sampling_sigmas is None
                         else functools.partial(training.sampling_sigmas, config)),
        corrupt_cond=None if training.corrupt_cond is None else functools.partial(training.corrupt_cond, config))


def _memory_spec(config: ModelConfig, module: nn.Module, groups: Mapping[str, tuple[str, ...]], weights: Weights,
                 architecture: tuple[str, ...]) -> memory.ModelSpec:
    """The dry run's :class:`fvx.distributed.memory.ModelSpec` of the model from its meta skeleton."""
    family, preset = config.family, config.spec
    root_dim, widths = family.architecture.widths(config)
    activations = {**family.architecture.activations, **preset.options.get("activations", {})}
    unit_specs = tuple(memory.UnitGroup(name, len(units), *widths[family_group(name)],
                                        activations[family_group(name)],
                                        text_tokens=family_group(name) in family.architecture.text_groups)
                       for name, units in groups.items())
    return memory.ModelSpec(shapes=dfolder.param_shapes(module),
                            units=tuple(u for units in groups.values() for u in units),
                            groups=unit_specs, dim=root_dim, text_len=preset.text_len,
                            vae_stride=preset.latents.vae_stride, patch=_patch(config),
                            compute_bytes=DTYPES[config.compute_dtype].itemsize, remat=config.remat,
                            reshard=config.reshard_after_forward,
                            frozen_bytes=DTYPES[config.frozen_dtype].itemsize, trained=weights.trained_names,
                            architecture=frozenset(architecture), base_id=weights.base_id(),
                            whole_id=weights.base_id(whole_model=True))


def _joint_sigmas(config: ModelConfig, modalities: tuple[str, ...], levels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each modality's levels at the shared ``levels``: the family's ``joint.sigmas``, else the shared ones."""
    if config.family.joint.sigmas is None:
        return {name: levels for name in modalities}
    return config.family.joint.sigmas(config, levels)


def _owner_untrained(family: Family, trained: tuple[str, ...], name: str) -> bool:
    """Whether param ``name`` belongs to a modality the model does not train (held frozen, as ``held_frozen`` params
    are)."""
    return any(modality.owns(name) for key, modality in family.joint.modalities.items() if key not in trained)


def _load_cond(spec: fcond.Spec, family: Family, image: frozenset[str], path: str, *,
               text_only: bool = False) -> tuple[dict[str, torch.Tensor], tuple[str, ...] | None]:
    """A cond file of the family's tensors; ``text_only``: without the given image's and those the unconditional
    blanks (a negative prompt)."""
    given = image | set(family.conditioning.blank)
    spec = {name: shape for name, shape in spec.items() if not (text_only and name in given)}
    return fcond.load(path, spec, family.name, defaults=family.conditioning.defaults)


def _model_batch(config: ModelConfig, spec: fcond.Spec, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A data batch as methods see it: the family's ``cond`` in place of the data entries it is made from; a joint
    model's ``latents`` a dict of the data's ``latents`` (video) and ``<modality>_latents`` (a ValueError names a
    missing one)."""
    family = config.family
    cond = family.conditioning.from_batch(config, raw)
    fcond.check(cond, spec, family.name, where="the batch's cond")
    batch = {**{key: value for key, value in raw.items() if key not in family.conditioning.data_keys}, "cond": cond}
    modalities = family.trained(config)
    if len(modalities) > 1 and "latents" in raw:
        others = tuple(f"{name}_latents" for name in modalities[1:])
        for key in others:
            if key not in raw:
                kind = "i2va" if "first_frame_latents" in raw else "t2va"
                raise ValueError(f"{family.name} trains {' and '.join(modalities)} together and needs the batch "
                                 f"tensor {key!r}, but the data has none ({kind} data: data.kind={kind})")
        batch["latents"] = {"video": raw["latents"], **{name: raw[key] for name, key in zip(modalities[1:], others)}}
        for key in others:
            del batch[key]
    return batch

