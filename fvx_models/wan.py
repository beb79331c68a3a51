"""Wan 2.1 text-to-video DiT (diffusers ``WanTransformer3DModel``) as pure functions over a flat params dict.

The diffusers module is built once as a *skeleton*: parameters on the meta device (any use of them fails loudly),
buffers (the RoPE tables) real. Every function takes that skeleton first and is bound to it by
:meth:`WanConfig.build`, which returns the :class:`fvx_models.model.Model` that methods see.

Params are fp32 masters keyed like the diffusers ``state_dict``. ``load``/``export`` read and write a diffusers
folder with safetensors only (never pickle, never a hub). Wan predicts the flow velocity ``noise - x0`` natively:
diffusers' ``WanPipeline`` feeds the transformer output to ``FlowMatchEulerDiscreteScheduler.step``, which computes
``x_next = x + (sigma_next - sigma) * out``, the Euler step of ``dx/dsigma = noise - x0`` for
``x = (1 - sigma) x0 + sigma noise``. So ``apply`` returns the module's output as it is.
"""
from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re
import shutil
import tempfile
import zlib
from typing import Any, Literal, Mapping, NamedTuple

import diffusers
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.func import functional_call

from fvx import compile as fvx_compile
from fvx import grad as fvx_grad
from fvx import memory, random, sharding
from fvx.config import Config
from fvx_models import diffusers_folder as dfolder
from fvx_models.model import Cond, Model, Params

# -------------------------------------------------------------------------------------------------------- presets

_WAN21 = dict(
    patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=1024, pos_embed_seq_len=None,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_WAN21, "num_attention_heads": 2, "attention_head_dim": 48, "text_dim": 32, "freq_dim": 32,
             "ffn_dim": 192, "num_layers": 2, "rope_max_seq_len": 32},
    "wan2.1-t2v-1.3b": {**_WAN21, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
    "wan2.1-t2v-14b": {**_WAN21, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
}
"""``WanTransformer3DModel`` constructor arguments per preset (every argument, so a config.json can be checked)."""

# Per-channel statistics of the Wan 2.1 VAE latents (``AutoencoderKLWan``'s ``latents_mean`` / ``latents_std``).
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


class Metadata(NamedTuple):
    """What a preset needs beyond the module: VAE latent statistics (per channel) and the text length (UMT5 pads to
    512 tokens; the model itself accepts any length)."""

    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    text_len: int


METADATA: dict[str, Metadata] = {
    "tiny": Metadata((0.0,) * 16, (1.0,) * 16, 8),
    "wan2.1-t2v-1.3b": Metadata(WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, 512),
    "wan2.1-t2v-14b": Metadata(WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, 512),
}

CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME = dfolder.CONFIG_NAME, dfolder.WEIGHTS_NAME, dfolder.WEIGHTS_INDEX_NAME
MAX_SHARD_BYTES = 10 * 10**9  # diffusers' default max_shard_size "10GB"


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown Wan preset {preset!r}; valid presets: {', '.join(PRESETS)}")


# -------------------------------------------------------------------------------------------------------- skeleton


def skeleton(preset: str, *, remat: bool = False) -> WanTransformer3DModel:
    """The diffusers module for ``preset`` with parameters on meta and real CPU buffers; no RNG is read.

    With ``remat`` the blocks recompute their activations in the backward through :func:`fvx.grad.remat` (pure
    checkpointing, effective only under grad).
    """
    _check_preset(preset)
    kwargs = PRESETS[preset]
    with torch.device("meta"):
        module = WanTransformer3DModel(**kwargs)
    with torch.device("cpu"):  # the RoPE tables are a pure function of the config
        module.rope = WanRotaryPosEmbed(kwargs["attention_head_dim"], kwargs["patch_size"], kwargs["rope_max_seq_len"])
    still_meta = [name for name, buffer in module.named_buffers() if buffer.is_meta]
    if still_meta:
        raise RuntimeError(f"Wan skeleton: buffers left on meta (diffusers changed?): {still_meta}")
    if remat:
        module.enable_gradient_checkpointing(fvx_grad.remat)
    return module


def _param_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _keeps_fp32(module: nn.Module, name: str) -> bool:
    """Whether diffusers keeps parameter ``name`` in fp32 under a low-precision dtype (its own matching rule)."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    return any(part in keep for part in name.split("."))


def units(module: nn.Module) -> list[str]:
    """The transformer blocks, as unit prefixes ("blocks.0.", ...): what compiles as one graph and gathers its shards
    as one unit (fvx.compile, fvx.sharding)."""
    return [f"blocks.{i}." for i in range(len(module.blocks))]


def compute_dtypes(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.dtype] | None:
    """Per param, the dtype it computes in: fp32 for the modules diffusers keeps in fp32, else ``dtype`` (None: as
    stored)."""
    if dtype is None:
        return None
    return {name: torch.float32 if _keeps_fp32(module, name) else dtype for name, _ in module.named_parameters()}


VAE_STRIDE = (4, 8, 8)  # Wan 2.1 VAE: time, height, width


def dims(preset: str, text_len: int | None = None) -> memory.DitDims:
    """The sizes fvx.memory and bench/flops.py need; ``text_len`` defaults to the preset's (512 for UMT5)."""
    _check_preset(preset)
    k = PRESETS[preset]
    return memory.DitDims(layers=k["num_layers"], dim=k["num_attention_heads"] * k["attention_head_dim"],
                          ffn_dim=k["ffn_dim"], text_len=METADATA[preset].text_len if text_len is None else text_len,
                          text_dim=k["text_dim"], in_channels=k["in_channels"], out_channels=k["out_channels"],
                          patch=tuple(k["patch_size"]), freq_dim=k["freq_dim"])


# ------------------------------------------------------------------------------------------------------------ init


def init(module: WanTransformer3DModel, key: torch.Tensor) -> Params:
    """Random fp32 params from an fvx key, keyed like the state_dict; no global RNG.

    PyTorch's default rules: Linear/Conv weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); norm weights one,
    biases zero; ``scale_shift_table`` ~ N(0, 1) / sqrt(dim) as diffusers. Each param's key is
    ``fold_in(key, crc32(name))``, so a param's values do not depend on what else the model holds.
    """
    params = {}
    for module_name, owner in module.named_modules():
        for local_name, param in owner.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            param_key = random.fold_in(key, zlib.crc32(name.encode()))
            params[name] = _init_param(param_key, owner, local_name, name, tuple(param.shape))
    return params


def _init_param(key: torch.Tensor, owner: nn.Module, local_name: str, name: str, shape: tuple[int, ...]):
    if isinstance(owner, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        bound = 1.0 / math.sqrt(math.prod(owner.weight.shape[1:]))
        return random.uniform(key, shape, minval=-bound, maxval=bound)
    if isinstance(owner, (nn.LayerNorm, nn.RMSNorm)):
        return torch.ones(shape) if local_name == "weight" else torch.zeros(shape)
    if local_name == "scale_shift_table":
        return random.normal(key, shape) / math.sqrt(shape[-1])
    raise ValueError(f"Wan init: no rule for parameter {name!r} of a {type(owner).__name__}")


# ----------------------------------------------------------------------------------------------------------- apply


def apply(
    module: WanTransformer3DModel,
    params: Params,
    x_t: torch.Tensor,
    t: torch.Tensor,
    cond: Cond,
    *,
    compute_dtype: torch.dtype | None = None,
    layout: sharding.Layout | None = None,
    group: sharding.Group | None = None,
) -> torch.Tensor:
    """Flow velocity ``noise - x0``, fp32 ``[B, C, T, H, W]``, of latents ``x_t [B, C, T, H, W]`` at ``t [B]`` (0..1000).

    ``cond["text"]`` is ``[B, L, text_dim]``. Wan has no text attention mask: it attends to all ``L`` tokens and was
    trained on UMT5 embeddings zero-padded to 512 (as diffusers' WanPipeline and FastVideo feed it), so an optional
    ``cond["text_mask"] [B, L]`` only zeroes the padded positions. ``compute_dtype`` (e.g. bf16) casts params and
    latents inside the call, except the modules diffusers keeps in fp32; gradients reach the caller's params in their
    own dtype. ``t`` stays fp32 (bf16 cannot hold 999). The RoPE tables move to ``x_t``'s device per call (~1 MB).

    Params may be stored in a lower precision than they compute in (a frozen teacher in bf16, fp32 where diffusers
    keeps fp32: ``Model.param_dtypes``): the compute dtype decides, so under ``compute_dtype`` fp32 a bf16-stored
    teacher computes in fp32 from its bf16-rounded weights (a full fp32 copy while it runs unsharded, one unit's
    sharded), and under bf16 its params are used as stored.

    Sharded (``layout`` and ``group`` given): ``params`` are this rank's local shards, the module's blocks were routed
    with a gathering function (:meth:`WanConfig.build`), and each unit gathers its params in the compute dtype (the
    cast sits inside the gather, so gradients are reduced in fp32).
    """
    x_t, t, text = _check_inputs(module, x_t, t, cond)
    if compute_dtype is not None:
        x_t, text = x_t.to(compute_dtype), text.to(compute_dtype)
    buffers = {name: b.to(x_t.device) for name, b in module.named_buffers()}
    inputs = {"hidden_states": x_t, "timestep": t, "encoder_hidden_states": text, "return_dict": False}
    if layout is not None:
        (out,) = sharding.sharded_call(module, params, buffers, (), inputs, layout=layout, group=group,
                                       compute_dtypes=compute_dtypes(module, compute_dtype))
        return out.float()
    if compute_dtype is not None:
        params = {name: p.to(torch.float32 if _keeps_fp32(module, name) else compute_dtype) for name, p in params.items()}
    (out,) = functional_call(module, (params, buffers), (), inputs, strict=True)
    return out.float()


def _check_inputs(module: WanTransformer3DModel, x_t, t, cond) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, t as fp32, masked text) after checking shapes; a ValueError names the culprit."""
    channels, text_dim, patch = module.config.in_channels, module.config.text_dim, tuple(module.config.patch_size)
    if not (isinstance(x_t, torch.Tensor) and x_t.dim() == 5 and x_t.shape[1] == channels
            and all(size % p == 0 for size, p in zip(x_t.shape[2:], patch))):
        got = tuple(x_t.shape) if isinstance(x_t, torch.Tensor) else type(x_t).__name__
        raise ValueError(f"Wan apply: x_t must be [B, {channels}, T, H, W] with T, H, W divisible by {patch}, got {got}")
    batch = x_t.shape[0]
    if not (isinstance(t, torch.Tensor) and tuple(t.shape) == (batch,)):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"Wan apply: t must be a tensor of shape [{batch}] (one timestep per sample), got {got}")
    if not isinstance(cond, Mapping) or "text" not in cond:
        raise ValueError(f"Wan apply: cond must be a mapping with a 'text' entry [B, L, {text_dim}]")
    text = cond["text"]
    if not (isinstance(text, torch.Tensor) and text.dim() == 3 and text.shape[0] == batch and text.shape[2] == text_dim):
        got = tuple(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
        raise ValueError(f"Wan apply: cond['text'] must be [{batch}, L, {text_dim}], got {got}")
    mask = cond.get("text_mask")
    if mask is not None:
        if not (isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(text.shape[:2])):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"Wan apply: cond['text_mask'] must be {list(text.shape[:2])}, got {got}")
        text = text * mask[..., None].to(text.dtype)
    return x_t, t.to(torch.float32), text


# ---------------------------------------------------------------------------------------------- latent statistics


def _channel_stats(stats: tuple[float, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(stats, dtype=torch.float32, device=like.device).view(1, -1, 1, 1, 1)


def normalize(latents: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """VAE latents ``[B, C, T, H, W]`` -> DiT input scale: ``(x - mean_c) / std_c``, computed in fp32, in x's dtype."""
    return ((latents.float() - _channel_stats(mean, latents)) / _channel_stats(std, latents)).to(latents.dtype)


def denormalize(latents: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """The inverse of :func:`normalize`: ``x * std_c + mean_c``, before a VAE decode."""
    return (latents.float() * _channel_stats(std, latents) + _channel_stats(mean, latents)).to(latents.dtype)


# ------------------------------------------------------------------------------------------------------------ load


def load(module: WanTransformer3DModel, folder: str | os.PathLike) -> Params:
    """fp32 params from a local diffusers folder: a transformer folder (``config.json`` + safetensors, single or
    sharded with an index json) or a pipeline root holding one under ``transformer/``. Never touches a hub.

    The folder's config.json must describe the skeleton's architecture, and its weights must hold exactly the
    skeleton's params with their shapes; otherwise one ValueError lists every difference.
    """
    folder = dfolder.component_folder(pathlib.Path(folder), "transformer", "Wan load", "transformer")
    dfolder.check_config(folder, module, "Wan load")
    files = dfolder.weight_files(folder, "Wan load")
    shapes = {name: shape for name, shape in dfolder.stored_shapes(files).items() if not _ignored_on_load(module, name)}
    _check_tensors(module, shapes, f"weights in {str(folder)!r}")
    params = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in shapes:
                    params[name] = f.get_tensor(name).to(torch.float32)
    return {name: params[name] for name in _param_shapes(module)}


def _ignored_on_load(module: nn.Module, name: str) -> bool:
    patterns = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(pattern, name) for pattern in patterns)


def _check_tensors(module: nn.Module, shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """One ValueError naming missing keys, unexpected keys and shape mismatches of ``shapes`` against the skeleton."""
    problems = dfolder.shape_problems(_param_shapes(module), shapes)
    if problems:
        raise ValueError(f"Wan: {what} do not fit the model: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------- export


def pipeline_files(folder: str | os.PathLike, *, flow_shift: float = 3.0) -> None:
    """Write diffusers' ``WanPipeline`` files beside an exported ``transformer/``: ``model_index.json`` and
    ``scheduler/`` (a ``FlowMatchEulerDiscreteScheduler`` with ``flow_shift``). The VAE, text encoder and tokenizer
    that model_index.json names are not fvx's to write: copy them from the base model."""
    folder = pathlib.Path(folder)
    FlowMatchEulerDiscreteScheduler(shift=flow_shift).save_config(folder / "scheduler")
    index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "AutoTokenizer"]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def export(
    module: WanTransformer3DModel,
    params: Params,
    folder: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write ``params`` as a diffusers transformer folder (config.json + safetensors, sharded with an index json above
    ``max_shard_bytes``) that ``WanTransformer3DModel.from_pretrained`` loads.

    ``dtype`` (e.g. bf16) casts every param but the fp32-kept modules, as diffusers' ``torch_dtype`` does. The folder
    is written beside its destination and renamed into place, so an error leaves nothing half-written; an existing
    non-empty ``folder`` is an error.
    """
    folder = pathlib.Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"Wan export: {str(folder)!r} already exists and is not an empty folder")
    if max_shard_bytes <= 0:
        raise ValueError(f"Wan export: max_shard_bytes must be positive, got {max_shard_bytes}")
    if not isinstance(params, Mapping):
        raise TypeError(f"Wan export: params must be a dict of tensors, got {type(params).__name__}")
    not_tensors = [name for name, value in params.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise TypeError(f"Wan export: params must map names to tensors; not tensors: {dfolder.listed(not_tensors)}")
    _check_tensors(module, {name: tuple(p.shape) for name, p in params.items()}, "params")
    tensors = {name: _exported(module, name, params[name], dtype) for name in _param_shapes(module)}
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        module.save_config(staging)
        _write_weights(tensors, staging, max_shard_bytes)
        staging.chmod(0o755)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _exported(module: nn.Module, name: str, param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    param = param.detach().to("cpu")
    if dtype is not None and param.is_floating_point():
        param = param.to(torch.float32 if _keeps_fp32(module, name) else dtype)
    return param.contiguous()


def _write_weights(tensors: dict[str, torch.Tensor], folder: pathlib.Path, max_shard_bytes: int) -> None:
    """One safetensors file, or numbered shards of at most ``max_shard_bytes`` (a bigger tensor gets its own) plus
    diffusers' index json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], folder / WEIGHTS_NAME, metadata=metadata)
        return
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------------- config


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class WanConfig(Config, tag="wan"):
    """A Wan 2.1 T2V DiT: architecture preset, optional local diffusers folder to start from, remat, compute dtype, and
    how its blocks run: ``compile="none"`` eagerly, ``"blocks"`` through one ``torch.compile``'d function shared by all
    blocks (fvx.compile; ``compile_backend`` "inductor", or "aot_eager" to check numerics without codegen)."""

    preset: str = "tiny"
    path: str | None = None  # a transformer folder with config.json, or a pipeline root with transformer/
    remat: bool = False
    compute_dtype: Literal["fp32", "bf16"] = "fp32"
    compile: fvx_compile.Mode = "none"
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        _check_preset(self.preset)

    def build(self, *, mesh: Any = None) -> Model:
        """The :class:`Model` whose functions are bound to one skeleton built now and to this config. On a device mesh
        (``fvx.sharding.make_mesh``) params are sharded: ``initial_params`` gives local shards and ``apply`` gathers
        each unit's in the compute dtype just before it runs."""
        module = skeleton(self.preset, remat=self.remat)
        kwargs, meta = PRESETS[self.preset], METADATA[self.preset]
        dtype = _DTYPES[self.compute_dtype]
        init_fn = functools.partial(init, module)
        load_fn = functools.partial(load, module)
        path = self.path
        blocks = units(module)
        shapes = _param_shapes(module)
        layout = group = None
        if mesh is not None:
            group = sharding.group_of(mesh)
            layout = sharding.plan(shapes, group.shard_size)
        stats = None
        if self.compile != "none" or layout is not None:
            gather = None if layout is None else sharding.unit_gather(layout, blocks, group,
                                                                      compute_dtypes(module, dtype))
            stats = fvx_compile.install_units(module, blocks, mode=self.compile, gather=gather,
                                              backend=self.compile_backend)

        def initial_params(key: torch.Tensor) -> Params:
            full = load_fn(path) if path is not None else init_fn(key)
            if mesh is None:
                return full
            return sharding.to_local(sharding.shard(full, mesh, layout=layout))

        def memory_spec() -> Any:
            from fvx.dry_run import ModelSpec  # the dry run only

            return ModelSpec(shapes=shapes, dims=dims(self.preset), units=tuple(blocks), vae_stride=VAE_STRIDE,
                             compute_bytes=dtype.itemsize, remat=self.remat)

        return Model(
            name=f"wan:{self.preset}",
            latent_channels=kwargs["in_channels"],
            text_dim=kwargs["text_dim"],
            patch_size=tuple(kwargs["patch_size"]),
            init=init_fn,
            load=load_fn,
            export=functools.partial(export, module),
            pipeline_files=pipeline_files,
            initial_params=initial_params,
            apply=functools.partial(apply, module, compute_dtype=dtype, layout=layout, group=group),
            normalize=functools.partial(normalize, mean=meta.latents_mean, std=meta.latents_std),
            denormalize=functools.partial(denormalize, mean=meta.latents_mean, std=meta.latents_std),
            layout=layout,
            compile_stats=None if self.compile == "none" else stats,
            memory_spec=memory_spec,
            param_dtypes=functools.partial(compute_dtypes, module),
        )
