"""AnyFlow stage 1: train a two-time student ``u(x_t, t, r)`` into a flow map on data (FastVideo's
AnyFlowPretrainMethod, spec §2.7), as pure functions.

Per sample (times in 0..1000, ``sigma = t / 1000``; keys ``fold_in(step_key, sample_index)``): a pair ``t >= r``
(``fvx_methods.library.flow_map.time_pairs``: two uniforms sorted, shifted by ``shift``; a ``diffusion_ratio`` of
samples with ``r = t``, a ``consistency_ratio`` with ``r = 0``), ``x_t = (1 - sigma) x0 + sigma noise`` and

    u       = student(x_t, t, r)                          guided by fusion when g != 1:
    u       = (u - (1 - g) sg(student(x_t, t, r; uncond))) / g
    dF/dt   = sg(d/dt student(x_t + ((t' - t)/1000)(noise - x0), t', r)) / g     along the data's straight path
    target  = (noise - x0) - (t - r) dF/dt
    l_b     = mean((u - target)^2) w(sigma_t) / E[w]      w: uniform, gaussian or beta08 (sigma sqrt(1 - sigma))
    l_b     = l_b * sg(mean_diffusion(l) / (l_b + 1e-5))  for the samples with r != t
    loss    = mean_b l_b

``dF/dt`` is FastVideo's central difference of ``epsilon`` timesteps (``derivative=finite_difference``), one-sided
where ``t +- epsilon`` leaves [0, 1000] as FastVideo's docstring promises, or exact (``ad``, ``dual``:
``fvx.core.derivatives``). Where fvx differs from FastVideo on purpose (docs/design.md, "AnyFlow"): a sample's kind is
drawn from its key (FastVideo takes the first ``int(ratio B)`` of each rank's batch), the weights are divided by
their mean under the time density (FastVideo by the rank batch's sum over 1000, a loss scale of ``1000 / B``), and
the diffusion mean is over the step's micro-batch on every rank (FastVideo: the rank's), so 1 process computes what
N do; and the times stay fp32 everywhere (``t``, ``r``, ``t +- epsilon``, ``t - r``), where FastVideo casts ``t`` and
``r`` to the latents' dtype, bf16 (``fastvideo/train/methods/distribution_matching/anyflow_pretrain.py:254,269-270``):
that rounds them to multiples of 4 from 512 up (``t = 999`` is 1000), and its central difference then spans the 8
timesteps between ``bf16(t + 5)`` and ``bf16(t - 5)`` while dividing by 10.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import derivatives, flow, role
from fvx.core.state import Batch, Program
from fvx_methods.library import flow_map, one_role
from fvx_models.model import Cond, Model, Params, check_shared_data

STUDENT = one_role.STUDENT
WEIGHTS = ("uniform", "gaussian", "beta08")


def train_weight(sigma: torch.Tensor, kind: str) -> torch.Tensor:
    """FastVideo's per-timestep weight of ``sigma [B]`` in [0, 1] (``FlowMapEulerDiscreteScheduler``)."""
    sigma = sigma.clamp(0.0, 1.0)
    if kind == "gaussian":
        return torch.exp(-0.5 * ((sigma - 0.5) / 0.2) ** 2)
    if kind == "beta08":
        return sigma * torch.sqrt(1.0 - sigma)
    return torch.ones_like(sigma)


@functools.lru_cache(maxsize=None)
def mean_weight(kind: str, shift: float, points: int = 100_000) -> float:
    """``E[w]`` of the pretrain's ``t``: the shifted larger of two uniforms (density ``2u``), by the midpoint rule."""
    u = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    return float((2 * u * train_weight(flow.shift_sigma(u, shift), kind)).mean())


# ---------------------------------------------------------------------------------------------------------- the loss


def time_derivative(model: Model, params: Params, x_t: torch.Tensor, t: torch.Tensor, r: torch.Tensor, cond: Cond,
                    velocity: torch.Tensor, config: AnyFlowPretrain) -> torch.Tensor:
    """``d/dt u(x_t + ((t' - t) / 1000) velocity, t', r)`` at ``t' = t`` (per timestep unit), no gradient."""
    with torch.no_grad():
        if config.derivative != "finite_difference":
            return derivatives.directional(lambda x, t: model.apply(params, x, t, cond, r=r), (x_t, t),
                                           (velocity / flow.NUM_TRAIN_TIMESTEPS, torch.ones_like(t)),
                                           mode=config.derivative)
        ahead = (t + config.epsilon).clamp(max=flow.NUM_TRAIN_TIMESTEPS)
        behind = (t - config.epsilon).clamp(min=0.0)

        def at(time: torch.Tensor) -> torch.Tensor:
            moved = x_t + flow_map.per_sample((time - t) / flow.NUM_TRAIN_TIMESTEPS, x_t) * velocity
            return model.apply(params, moved, time, cond, r=r)
        return (at(ahead) - at(behind)) / flow_map.per_sample(ahead - behind, x_t)


def loss_fn(params: Params, batch: Batch, key: torch.Tensor, *, model: Model, config: AnyFlowPretrain,
            ranks: role.Ranks, negative: Cond | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The pretrain loss of ``batch`` (latents ``[B, C, T, H, W]``, cond, sample_index ``[B]``) under the step key."""
    x0 = model.normalize(batch["latents"].float())
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma_t, sigma_r, kind = flow_map.time_pairs(t_keys, diagonal=config.diffusion_ratio,
                                                 endpoint=config.consistency_ratio, shift=config.shift)
    t, r = sigma_t * flow.NUM_TRAIN_TIMESTEPS, sigma_r * flow.NUM_TRAIN_TIMESTEPS
    x_t, cond, g = flow.add_noise(x0, noise, sigma_t), batch["cond"], config.fuse_guidance_scale
    u = model.apply(params, x_t, t, cond, r=r)
    if g != 1.0:
        with torch.no_grad():
            u_uncond = model.apply(params, x_t, t, model.uncond(cond, config.cfg_uncond, negative), r=r)
        u = (u - (1.0 - g) * u_uncond) / g
    velocity = flow.velocity_target(x0, noise)
    target = velocity - flow_map.per_sample(t - r, x0) * time_derivative(model, params, x_t, t, r, cond, velocity,
                                                                        config) / g
    per = ((u - target) ** 2).flatten(1).mean(1)
    per = per * train_weight(sigma_t, config.weight_type) / mean_weight(config.weight_type, config.shift)
    with torch.no_grad():
        diffusion = (kind == flow_map.DIAGONAL).float()
        sums = ranks.mean(torch.stack([(per * diffusion).sum(), diffusion.sum(), per.sum(),
                                       torch.tensor(float(per.numel()), device=per.device)]))
        diffusion_mean = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1.0), sums[2] / sums[3])
        scale = torch.where(diffusion > 0, torch.ones_like(per), diffusion_mean / (per + 1e-5))
    return (per * scale).mean(), {"diffusion_fraction": diffusion.mean(),
                                  "consistency_fraction": (kind == flow_map.ENDPOINT).float().mean(),
                                  "scale_weight_mean": scale[diffusion == 0].mean() if (diffusion == 0).any()
                                  else torch.ones(())}


# -------------------------------------------------------------------------------------------------------- the build


class AnyFlowPretrainRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class AnyFlowPretrain(one_role.OneRoleConfig, tag="anyflow_pretrain"):
    """Knobs of AnyFlow's flow-map pretraining (FastVideo's ``method.*``; module docstring), beside the one-role
    knobs: ``diffusion_ratio`` / ``consistency_ratio`` (the fractions of samples with ``r = t`` / ``r = 0``),
    ``epsilon`` (the finite difference's step in timesteps), ``weight_type``, ``fuse_guidance_scale`` (``g``; its
    unconditional cond ``cfg_uncond``, ``negative_prompt``: the cond file ``negative_prompt_path``), ``shift`` (of
    the time pairs; FastVideo's ``pipeline.flow_shift``), ``derivative`` (``finite_difference``, or exact
    ``ad``/``dual``, eager only) and ``sample_steps`` (the validation's jump counts)."""

    roles: AnyFlowPretrainRoles = AnyFlowPretrainRoles()
    diffusion_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    consistency_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.25
    epsilon: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    weight_type: Literal["uniform", "gaussian", "beta08"] = "beta08"
    fuse_guidance_scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None
    shift: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    derivative: derivatives.Mode = "finite_difference"
    sample_steps: tuple[Annotated[int, msgspec.Meta(ge=1)], ...] = (1, 2, 4)

    def __post_init__(self) -> None:
        super().__post_init__()
        flow_map.check_fractions(self.diffusion_ratio, self.consistency_ratio,
                                 ("diffusion_ratio", "consistency_ratio"))

    @property
    def name(self) -> str:
        return "AnyFlow pretraining"

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export)."""
        return flow_map.sampling(self.sample_steps, self.shift) if role_name == STUDENT else None

    def check_models(self, models: Mapping[str, Model]) -> None:
        """The student's r input and the derivative's mode, from its skeleton: :meth:`build` and the dry run call
        it."""
        check_shared_data(models, data_role=STUDENT)
        model = models[STUDENT]
        flow_map.check_two_time(model, self.roles.student, self.name)
        derivatives.check_mode(self.derivative, compiled=model.kernels.compile_stats is not None,
                               sharded=model.weights.layout is not None, who="method.derivative",
                               no_forward_ad=model.rules.forward_ad_refusal)

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program for the two-time student; its r input, the derivative's mode (:meth:`check_models`)
        and the negative prompt are checked now, before any weight loads."""
        self.check_models(models)
        model = models[STUDENT]
        negative = (None if self.negative_prompt_path is None or self.fuse_guidance_scale == 1.0
                    else model.load_negative(self.negative_prompt_path, "method.negative_prompt_path"))
        loss = functools.partial(loss_fn, model=model, config=self, ranks=ranks, negative=negative)
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=loss, logged=logged, check=lambda batch: check_batch(batch, model, self, negative),
                                samplers=flow_map.samplers(model, self.sample_steps, self.shift))


def logged(loss: torch.Tensor, aux: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {"loss": loss, **aux}


def check_batch(batch: Batch, model: Model, config: AnyFlowPretrain, negative: Cond | None) -> None:
    """A ValueError when the batch does not fit (once, before the first step)."""
    one_role.check_data(batch, model, config.grad_accum)
    if config.fuse_guidance_scale != 1.0:
        model.uncond(batch["cond"], config.cfg_uncond, negative)  # a negative prompt is there when needed
