"""The distribution-matching core of DMD2 and its kin (Self-Forcing, causal distillation): the real and fake scores of
a generated sample, the DMD loss, and the critic's flow-matching loss, as pure functions parameterised by a rollout
(how the student generates ``x0_gen``) and a small :class:`Score` config.

Per sample ``b`` of a batch, with ``x0_gen`` the student's sample and ``g`` the guidance scale::

    t_b      = clamp(shift_timestep(randint[0, 1000), timestep_shift), window)        per sample
    x_t      = (1 - sigma(t_b)) x0_gen + sigma(t_b) eps
    x0_fake  = critic x0(x_t, t; cond)
    x0_real  = teacher x0(x_t, t; uncond) + g (teacher x0(x_t, t; cond) - teacher x0(x_t, t; uncond))
    grad_b   = nan_to_num((x0_fake - x0_real)_b / mean_{C,T,H,W} |x0_gen - x0_real|_b)   per-sample normaliser
    L_gen    = 0.5 mean((x0_gen - sg(x0_gen - grad))^2)       so dL_gen/dx0_gen = grad / numel
    L_critic = mean((v_critic(x_t', t') - (eps' - sg(x0_gen')))^2) on a fresh rollout x0_gen'

as in the DMD2 paper and FastVideo's recipe (one sample per rank, so its per-rank draws and normaliser are per
sample). ``x0(x_t, t) = x_t - sigma(t) v(x_t, t)`` with ``sigma(t)`` the level of the model's training grid
(``training_sigmas(flow_shift)``) whose timestep is nearest ``t``, as FastVideo's schedulers look it up; the model
itself is called at ``t``. Guidance is fvx's ``uncond + g (cond - uncond)`` (design §2); with ``g == 1`` the teacher's
unconditional call is skipped. Draws: a sample's score timestep and noise come from ``fold_in(key', global sample
index)`` (``key'`` a sub-key of the loss's key per draw), so nothing depends on how ranks or micro-batches split the
batch.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fvx.core import flow, random
from fvx.core.state import Batch
from fvx_models.model import Cond, Model, Params

Rollout = Callable[[Params, Batch, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]
"""``rollout(student_params, batch, key, with_grad) -> (x0_gen [B, C, T, H, W], the graded timesteps [B])``."""


class Score(NamedTuple):
    """How scores are taken: the models' training-grid shift, the score timesteps' shift and window ``[min, max]``
    (ratios of 1000), the teacher's guidance scale and its unconditional cond (``"negative_prompt"``, ``"zero"`` or
    ``"keep"``)."""

    flow_shift: float
    timestep_shift: float
    min_timestep_ratio: float
    max_timestep_ratio: float
    guidance_scale: float
    cfg_uncond: str

    def grid(self, device: torch.device) -> torch.Tensor:
        return flow.training_sigmas(self.flow_shift, device=device)


def denoising_timesteps(steps: tuple[int, ...], warp: bool, flow_shift: float) -> torch.Tensor:
    """The student's step timesteps ``[K]`` fp32: ``steps``, or with ``warp`` the shifted-grid values
    ``cat(1000 training_sigmas(flow_shift), [0])[1000 - s]``."""
    if not warp:
        return torch.tensor(steps, dtype=torch.float32)
    table = torch.cat([flow.to_timestep(flow.training_sigmas(flow_shift)), torch.zeros(1)])
    return table[flow.NUM_TRAIN_TIMESTEPS - torch.tensor(steps, dtype=torch.int64)]


def per_sample_normal(key: torch.Tensor, sample_index: torch.Tensor, draw: int, shape: tuple[int, ...],
                      device: torch.device) -> torch.Tensor:
    """Noise ``[B, *shape]``: sample b's draw number ``draw`` is ``normal(fold_in(fold_in(key, draw), index_b))``."""
    keys = random.fold_in(random.fold_in(key, draw), sample_index.to(key.device))
    return random.normal_each(keys, shape, device=device)


def per_sample_randint(key: torch.Tensor, sample_index: torch.Tensor, high: int) -> torch.Tensor:
    """``[B]`` int64: sample b's ``randint[0, high)`` from ``fold_in(key, index_b)``."""
    return random.randint_each(random.fold_in(key, sample_index.to(key.device)), (), 0, high)


def score_window(score: Score) -> tuple[int, int]:
    """``(int(1000 min_ratio), int(1000 max_ratio))``, the window score timesteps are clamped to."""
    n = flow.NUM_TRAIN_TIMESTEPS
    return int(score.min_timestep_ratio * n), int(score.max_timestep_ratio * n)


def score_timesteps(key: torch.Tensor, sample_index: torch.Tensor, score: Score) -> torch.Tensor:
    """``[B]`` fp32 score timesteps: per sample ``t0 ~ randint[0, 1000)``, shifted by ``timestep_shift``, clamped to
    [0, 1000], then to the window."""
    t0 = per_sample_randint(key, sample_index, flow.NUM_TRAIN_TIMESTEPS).to(torch.float32)
    t = torch.clamp(flow.shift_timestep(t0, score.timestep_shift), 0, flow.NUM_TRAIN_TIMESTEPS)
    lo, hi = score_window(score)
    return torch.clamp(t, lo, hi)


def predict_x0(model: Model, params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond,
               grid: torch.Tensor) -> torch.Tensor:
    """``x_t - sigma(t) v(x_t, t)`` for latents ``[B, C, T, H, W]`` at timesteps ``t [B]``, with ``sigma(t)`` the
    nearest level of ``grid``."""
    v = model.apply(params, x_t, t, cond)
    return flow.x0_from_velocity(x_t, v, flow.nearest_grid_sigma(grid, t))


def noised(x0: torch.Tensor, sample_index: torch.Tensor, key: torch.Tensor, score: Score,
           grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, noise, t [B]): score timesteps from ``split(key)[0]``, per-sample noise from ``split(key)[1]``."""
    t_key, noise_key = random.split(key)
    t = score_timesteps(t_key, sample_index, score).to(x0.device)
    noise = per_sample_normal(noise_key, sample_index, 0, tuple(x0.shape[1:]), x0.device)
    return flow.add_noise(x0, noise, flow.nearest_grid_sigma(grid, t)), noise, t


def real_and_fake_x0(critic_params: Params, teacher_params: Params, x0_gen: torch.Tensor, batch: Batch,
                     key: torch.Tensor, *, critic: Model, teacher: Model, score: Score,
                     negative: Cond | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x0_fake, x0_real, t [B])`` of the sample ``x0_gen`` noised at per-sample score timesteps (no grad): the
    critic's x0 and the teacher's guided x0."""
    grid = score.grid(x0_gen.device)
    cond = batch["cond"]
    with torch.no_grad():
        x_t, _, t = noised(x0_gen.detach(), batch["sample_index"], key, score, grid)
        x0_fake = predict_x0(critic, critic_params, x_t, t, cond, grid)
        x0_cond = predict_x0(teacher, teacher_params, x_t, t, cond, grid)
        if score.guidance_scale == 1.0:
            return x0_fake, x0_cond, t
        uncond = teacher.uncond(cond, score.cfg_uncond, negative)
        x0_uncond = predict_x0(teacher, teacher_params, x_t, t, uncond, grid)
        return x0_fake, flow.cfg(x0_cond, x0_uncond, score.guidance_scale), t


def dmd_loss(x0_gen: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(0.5 mean((x0_gen - sg(x0_gen - grad))^2), normaliser [B])`` with each sample's
    ``grad_b = nan_to_num((x0_fake - x0_real)_b / mean|x0_gen - x0_real|_b)``, in fp32, so that
    ``d loss / d x0_gen = grad / numel`` (up to the rounding of ``x0_gen - (x0_gen - grad)``)."""
    x0_gen = x0_gen.float()
    with torch.no_grad():
        normalizer = (x0_gen - x0_real.float()).abs().mean(dim=tuple(range(1, x0_gen.dim())))
        shape = (-1,) + (1,) * (x0_gen.dim() - 1)
        direction = torch.nan_to_num((x0_fake.float() - x0_real.float()) / normalizer.view(shape))
        target = x0_gen - direction
    return 0.5 * torch.mean((x0_gen - target) ** 2), normalizer


def generator_loss(student_params: Params, batch: Batch, critic_params: Params, teacher_params: Params,
                   key: torch.Tensor, *, rollout: Rollout, critic: Model, teacher: Model, score: Score,
                   negative: Cond | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DMD loss of the student (module docstring), differentiable in ``student_params`` through the rollout's
    graded call only. ``split(key)`` gives the rollout key and the score key. aux (means over the batch):
    ``dmd_normalizer``, ``generator_timestep`` (the rollout's graded timesteps), ``score_timestep``."""
    rollout_key, score_key = random.split(key)
    x0_gen, t_gen = rollout(student_params, batch, rollout_key, True)
    x0_fake, x0_real, t = real_and_fake_x0(critic_params, teacher_params, x0_gen, batch, score_key, critic=critic,
                                           teacher=teacher, score=score, negative=negative)
    loss, normalizer = dmd_loss(x0_gen, x0_fake, x0_real)
    return loss, {"dmd_normalizer": normalizer.mean(), "generator_timestep": t_gen.float().mean(),
                  "score_timestep": t.mean()}


def critic_loss(critic_params: Params, batch: Batch, student_params: Params, key: torch.Tensor, *, rollout: Rollout,
                critic: Model, score: Score) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's flow-matching loss on a fresh student sample: ``mean((v(x_t, t) - (eps - x0_gen))^2)``. Key
    layout as :func:`generator_loss`; the rollout runs without grad. aux: ``generator_timestep``,
    ``score_timestep`` (means)."""
    rollout_key, score_key = random.split(key)
    with torch.no_grad():
        x0_gen, t_gen = rollout(student_params, batch, rollout_key, False)
    x_t, noise, t = noised(x0_gen, batch["sample_index"], score_key, score, score.grid(x0_gen.device))
    v = critic.apply(critic_params, x_t, t, batch["cond"]).float()
    loss = torch.mean((v - flow.velocity_target(x0_gen, noise)) ** 2)
    return loss, {"generator_timestep": t_gen.float().mean(), "score_timestep": t.mean()}
