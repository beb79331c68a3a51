"""The tiny model of every family the tests run, with inputs drawn from its cond spec and an independent reference:
the diffusers module(s) called directly, with the arguments their own pipeline passes."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from diffusers import (AnyFlowTransformer3DModel, HunyuanVideoTransformer3DModel, SkyReelsV2Transformer3DModel,
                       WanTransformer3DModel)

from fvx.core import grad, random
from fvx.distributed import processes, sharding
from fvx_models.anyflow import AnyFlowConfig
from fvx_models.build import ModelConfig
from fvx_models.hunyuan_video import HunyuanVideoConfig
from fvx_models.skyreels_v2 import SkyReelsV2Config
from fvx_models.wan import WanConfig
from fvx_models.wan_moe import Wan22MoEConfig


class Case(NamedTuple):
    config: ModelConfig
    classes: dict[str, type]  # pipeline component -> its diffusers class
    native: Callable  # (modules by component, x, t, cond) -> velocity


def _fresh(cls: type, kwargs: dict, params: dict) -> torch.nn.Module:
    """A real diffusers module holding ``params`` (torch's RNG state restored after its own init)."""
    state = torch.get_rng_state()
    module = cls(**kwargs)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    return module


def _masked(cond):
    return cond["text"] * cond["text_mask"][..., None]


def wan_native(modules, x, t, cond):
    return modules["transformer"](x, t, _masked(cond), return_dict=False)[0]


def ti2v_native(modules, x, t, cond):
    """WanPipeline with expand_timesteps: one timestep per token (all the sample's for text-to-video)."""
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    return modules["transformer"](x, t[:, None].expand(x.shape[0], tokens), _masked(cond), return_dict=False)[0]


def skyreels_fps_native(modules, x, t, cond):
    return modules["transformer"](x, t, _masked(cond), fps=[1] * x.shape[0], return_dict=False)[0]  # 24 fps


def moe_native(modules, x, t, cond):
    """WanPipeline's routing, one sample at a time: the high-noise expert at t >= 875."""
    rows = [modules["transformer" if float(t[b]) >= 875.0 else "transformer_2"](
        x[b:b + 1], t[b:b + 1], _masked(cond)[b:b + 1], return_dict=False)[0] for b in range(x.shape[0])]
    return torch.cat(rows)


def hunyuan_native(modules, x, t, cond):
    """HunyuanVideoPipeline's call: guidance passed as guidance_scale * 1000."""
    guidance = torch.full((x.shape[0],), 6.0) * 1000.0
    return modules["transformer"](x, t, cond["text"], cond["text_mask"], cond["pooled"], guidance=guidance,
                                  return_dict=False)[0]


def anyflow_native(modules, x, t, cond):
    """AnyFlowPipeline's call: frames first, one t and r per frame (r = t: the instantaneous velocity)."""
    frames = t[:, None].expand(x.shape[0], x.shape[2])
    out = modules["transformer"](x.permute(0, 2, 1, 3, 4), frames, frames, _masked(cond), return_dict=False)[0]
    return out.permute(0, 2, 1, 3, 4)


CASES: dict[str, Case] = {
    "wan": Case(WanConfig(preset="tiny"), {"transformer": WanTransformer3DModel}, wan_native),
    "wan-ti2v": Case(WanConfig(preset="tiny-ti2v"), {"transformer": WanTransformer3DModel}, ti2v_native),
    "skyreels_v2": Case(SkyReelsV2Config(preset="tiny"), {"transformer": SkyReelsV2Transformer3DModel}, wan_native),
    "skyreels_v2-fps": Case(SkyReelsV2Config(preset="tiny-fps"), {"transformer": SkyReelsV2Transformer3DModel},
                            skyreels_fps_native),
    "wan_moe": Case(Wan22MoEConfig(preset="tiny"), {"transformer": WanTransformer3DModel,
                                                    "transformer_2": WanTransformer3DModel}, moe_native),
    "hunyuan_video": Case(HunyuanVideoConfig(preset="tiny"), {"transformer": HunyuanVideoTransformer3DModel},
                          hunyuan_native),
    "anyflow": Case(AnyFlowConfig(preset="tiny"), {"transformer": AnyFlowTransformer3DModel}, anyflow_native),
}
FAMILIES = ["wan", "wan-ti2v", "skyreels_v2", "wan_moe", "hunyuan_video", "anyflow"]  # one case per family and layout


def native_modules(case: Case, params: dict) -> dict[str, torch.nn.Module]:
    """Each pipeline component as a real diffusers module holding its part of ``params``."""
    family, kwargs = case.config.family, dict(case.config.spec.kwargs)
    modules = {}
    for component, prefix in family.components.items():
        part = {name[len(prefix):]: p for name, p in params.items() if name.startswith(prefix)}
        modules[component] = _fresh(case.classes[component], kwargs, part)
    return modules


def inputs(model, key: torch.Tensor, *, batch: int = 2, frames: int = 2, size: int = 4, text_len: int = 5,
           t: tuple[float, ...] = (30.0, 910.5)):
    """(x_t, t, cond) for ``model``: normal latents and cond tensors from its spec, masks with padding in the last
    sample, per-sample timesteps (``t`` straddles Wan 2.2 A14B's boundary of 875)."""
    k = random.split(key, 2 + len(model.cond))
    x = random.normal(k[0], (batch, model.latents.channels, frames, size, size))
    cond = {}
    for i, (name, shape) in enumerate(model.cond.items()):
        dims = tuple(text_len if s == "L" else s for s in shape)
        if name == "text_mask":
            mask = torch.ones(batch, text_len)
            mask[-1, text_len - 2:] = 0
            cond[name] = mask
        else:
            cond[name] = random.normal(k[2 + i], (batch, *dims))
    return x, torch.tensor(t[:batch], dtype=torch.float32), cond


def raw_batch(model, key: torch.Tensor, *, batch: int = 2, frames: int = 2, size: int = 4, text_len: int = 5,
              first: int = 0) -> dict:
    """A data batch as fvx.data.datasets makes it, for ``model``'s family (HunyuanVideo's text packs the pooled vector
    as row 0, as FastVideo's data does)."""
    x, _, cond = inputs(model, key, batch=batch, frames=frames, size=size, text_len=text_len)
    if "pooled" in cond:
        pooled = torch.nn.functional.pad(cond["pooled"], (0, cond["text"].shape[-1] - cond["pooled"].shape[-1]))
        text = torch.cat([pooled[:, None], cond["text"]], dim=1)
        mask = torch.cat([torch.ones(batch, 1), cond["text_mask"]], dim=1)
    else:
        text, mask = cond["text"], cond["text_mask"]
    return {"latents": x, "text": text, "text_mask": mask, "sample_index": torch.arange(first, first + batch)}


def causal_loss_and_grads(config: ModelConfig, mesh=None, rows: Callable[[dict], dict] = lambda batch: batch):
    """Loss and full gradients of a tiny block-causal Wan (``config``: blocks of 1 frame) on a global batch of 4, of
    which this rank takes ``rows``: its per-frame-timestep forward, the teacher-forced one and a KV-cached chunk after
    a cached clean frame (on ``mesh``: the rank-mean loss and the unsharded gradients)."""
    model = config.build(**({} if mesh is None else {"mesh": mesh}))
    params = model.init(random.key(0))
    raw = raw_batch(model, random.key(40), batch=4)
    t = torch.tensor([[900.0, 10.0], [500.0, 600.0], [0.0, 999.0], [250.0, 250.0]])
    local = rows({**raw, "t": t})
    cond = model.batch({k: local[k] for k in raw})["cond"]
    x, clean = local["latents"], local["latents"].flip(-1)

    def loss_fn(p):
        full = model.apply(p, x, local["t"], cond)
        forced = model.causal.apply_teacher_forced(p, x, local["t"], cond, clean)
        _, cache = model.causal.apply_cached(p, clean[:, :, :1], local["t"][:, 0] * 0, cond,
                                             model.causal.empty_cache(x.shape[2]))
        cached, _ = model.causal.apply_cached(p, x[:, :, 1:], local["t"][:, 1], cond, cache)
        return full.square().mean() + forced.square().mean() + cached.square().mean()

    loss, grads = grad.value_and_grad(loss_fn)(params)
    if mesh is None:
        return float(loss), grads
    return float(processes.dp_mean(loss, processes.group_of(mesh))), sharding.unshard(grads, mesh)
