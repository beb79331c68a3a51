"""The model interface methods see: one DiT architecture as pure functions over a flat params dict.

A family module (``fvx_models.wan``, ...) builds a :class:`Model` from its config. Methods reach a model only
through these fields; they never touch the skeleton module. Tensors at this interface are in fvx's canonical
layout: latents ``[B, C, T, H, W]``, timesteps ``[B]`` on the 0..1000 scale (``t = 1000 sigma``), and the output is
the flow velocity ``v = noise - x0`` in the latents' layout, whatever the family predicts natively.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

Params = dict[str, torch.Tensor]
Cond = Mapping[str, torch.Tensor]  # {"text": [B, L, D], "text_mask": [B, L] (1 = real token)}


@dataclasses.dataclass(frozen=True)
class Model:
    """One architecture of a model family, as pure functions (see the module docstring for layouts).

    init(key) -> params          random params from an fvx key (tiny presets, tests)
    load(folder) -> params       a local diffusers-format folder, read with safetensors (no hub access)
    export(params, folder)       a folder that diffusers' ``from_pretrained`` loads
    initial_params(key)          the params a run starts from: ``load(path)`` when the config names a folder, else ``init``
    apply(params, x_t, t, cond)  velocity ``[B, C, T, H, W]``; remat and compute dtype are fixed by the config
    normalize(latents)           VAE latents -> the DiT's input scale (per-channel ``(x - mean) / std``)
    denormalize(latents)         the inverse, before a VAE decode
    pipeline_files(folder)       optional: writes the family's pipeline files (``model_index.json``, ``scheduler/``,
                                 ...) into an exported folder beside ``transformer/``; None writes none
    layout                       the shard layout (``fvx.sharding.plan``) when built on a device mesh, else None: then
                                 ``initial_params`` returns this rank's local shards and ``apply`` takes them (each
                                 block gathers its own); ``init``/``load``/``export`` still speak full params
    compile_stats                the ``fvx.compile.CompileStats`` of the compiled blocks, or None when not compiled
    memory_spec()                optional: an ``fvx.dry_run.ModelSpec`` (shapes from the skeleton, no weights) for
                                 ``--dry-run``
    param_dtypes(dtype)          optional: per param name, the dtype it is stored and computed in when the model runs
                                 in ``dtype``: ``dtype``, except the params the family keeps in fp32 (diffusers'
                                 ``_keep_in_fp32_modules``); how a method stores a frozen role in bf16
    """

    name: str
    latent_channels: int
    text_dim: int
    patch_size: tuple[int, int, int]
    init: Callable[[torch.Tensor], Params]
    load: Callable[[str], Params]
    export: Callable[[Params, str], None]
    initial_params: Callable[[torch.Tensor], Params]
    apply: Callable[[Params, torch.Tensor, torch.Tensor, Cond], torch.Tensor]
    normalize: Callable[[torch.Tensor], torch.Tensor]
    denormalize: Callable[[torch.Tensor], torch.Tensor]
    pipeline_files: Callable[[str], None] | None = None
    layout: Mapping[str, Any] | None = None
    compile_stats: Any = None
    memory_spec: Callable[[], Any] | None = None
    param_dtypes: Callable[[torch.dtype], dict[str, torch.dtype]] | None = None

    def check_latents(self, shape: tuple[int, ...], where: str = "latents") -> None:
        """Raise a ValueError naming both shapes unless ``shape`` is ``[B, C, T, H, W]`` that this model accepts."""
        ok = (
            len(shape) == 5
            and shape[1] == self.latent_channels
            and all(size % patch == 0 for size, patch in zip(shape[2:], self.patch_size))
        )
        if not ok:
            raise ValueError(
                f"{where} of shape {tuple(shape)} do not fit model {self.name}: it takes [B, C, T, H, W] with "
                f"C = {self.latent_channels} and T, H, W divisible by the patch size {self.patch_size}"
            )
