"""Flow-matching fine-tuning (FastVideo's FineTuneMethod, spec §2.1) as pure functions.

Per sample b of the global batch: ``x0`` the normalised latents, ``noise ~ N(0, I)``, ``u ~ density``, ``sigma`` the
training-grid entry at ``floor(1000 u)``, ``x_t = (1 - sigma) x0 + sigma noise``, ``v = model(x_t, 1000 sigma)``, and

    loss = mean((v - (noise - x0))^2)              (default)
    loss = mean((x_t - sigma v - x0)^2)            (precondition_outputs: the loss on the implied x0)

Noise and timesteps come from ``fold_in(step_key, global_sample_index)``, so a sample draws the same numbers whatever
the number of ranks or micro-batches. The role ``student`` is a model of any family (``roles.student`` names it);
its ``cond`` comes with the batch. Only the params the model trains (``Model.trainable``: all of them, unless the
model config freezes a part) are differentiated, optimised and averaged.

Data parallel (``build(..., mesh=...)``): params, gradients and AdamW state are this rank's local shards; each rank's
loss is the plain mean over its own slice of the global batch (the gathers' backward averages gradients over ranks),
the gradient norm and clipping are global (one all-reduce), and the logged loss is the mean over ranks.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

import msgspec
import torch

from fvx import ema, flow, grad, optim, random, sharding, tree, validation
from fvx.config import Config
from fvx.optim_config import AdamWConfig
from fvx.state import Batch, Metrics, Program, RoleState, TrainState, all_finite, skipped
from fvx_models.model import Model

ROLE = "student"


class FinetuneRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class Finetune(Config, tag="finetune"):
    """Knobs of fine-tuning: the optimizer, the timestep density, the loss form, gradient accumulation, and an EMA of
    the params (``ema_decay``, None or 0 for none): a copy at update ``max(ema_start_step, 1)``, then
    ``ema <- d ema + (1 - d) params`` after every update; validation and ``export --ema`` use it."""

    roles: FinetuneRoles = FinetuneRoles()
    optim: AdamWConfig = AdamWConfig()
    weighting_scheme: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False
    flow_shift: Annotated[float, msgspec.Meta(gt=0)] = 3.0
    grad_accum: Annotated[int, msgspec.Meta(ge=1)] = 1
    ema_decay: float | None = None
    ema_start_step: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.optim.lr <= 0:
            raise ValueError(f"fine-tuning needs optim.lr > 0, got {self.optim.lr}")
        if self.ema_decay:
            ema.check_decay(self.ema_decay)

    def build(self, models: Mapping[str, Model], *, total_steps: int, mesh: Any = None) -> Program:
        """The loop's program for this config, the student's model (``models["student"]``) and run length (the LR
        schedule needs it); on a device mesh (a model built on the same mesh) the step runs on local shards with
        global norms."""
        model = models[ROLE]
        group = sharding.Group() if mesh is None else sharding.group_of(mesh)
        tx = self.optim.build(total_steps, group)
        lr = self.optim.schedule_fn(total_steps)
        return Program(
            model=model,
            init=lambda run_key: init(run_key, model, tx, with_ema=bool(self.ema_decay)),
            step_=lambda state, frozen, batch: step_(state, batch, model=model, config=self, tx=tx, lr=lr,
                                                     group=group),
            check=lambda batch: check_batch(batch, model),
            validate=lambda state, frozen, validation_config: validate(state, validation_config, model=model),
        )

    def memory_plan(self, specs: Mapping[str, Any]) -> Any:
        """For ``--dry-run``: one trainable fp32 role with AdamW; a rank's batch runs in ``grad_accum`` pieces."""
        from fvx import dry_run, memory  # the dry run only

        return dry_run.Plan(roles=(memory.Role(ROLE, specs[ROLE], trainable=True),), micro_batches=self.grad_accum)


def check_batch(batch: Batch, model: Model) -> None:
    """Raise a ValueError naming both shapes when the batch's latents do not fit ``model`` (its cond was checked
    when the model made it)."""
    if "latents" not in batch:
        raise ValueError("fine-tuning needs latents, but the batch has none (text_only data?)")
    model.check_latents(tuple(batch["latents"].shape), where="batch latents")


def per_sample_noise(key: torch.Tensor, sample_index: torch.Tensor, shape: tuple[int, ...],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample keys ``fold_in(key, index)`` split into (noise ``[B, *shape]``, timestep keys ``[B, 2]``)."""
    sample_keys = torch.vmap(random.split)(random.fold_in(key, sample_index))
    return random.normal_each(sample_keys[:, 0], shape, device=device), sample_keys[:, 1]


def loss_fn(params: dict, batch: Batch, key: torch.Tensor, *, model: Model,
            config: Finetune) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fine-tuning loss of ``batch`` (latents ``[B, C, T, H, W]``, the model's cond, sample_index ``[B]``)
    under the step key ``key``; aux holds the drawn ``sigma [B]``."""
    x0 = model.normalize(batch["latents"].float())
    noise, t_keys = per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    grid = flow.training_sigmas(config.flow_shift, device=x0.device)
    sigma, t = flow.sample_training_sigmas(t_keys, grid, config.weighting_scheme, logit_mean=config.logit_mean,
                                           logit_std=config.logit_std, mode_scale=config.mode_scale)
    x_t = flow.add_noise(x0, noise, sigma)
    v = model.apply(params, x_t, t, batch["cond"]).float()
    if config.precondition_outputs:
        loss = torch.mean((flow.x0_from_velocity(x_t, v, sigma) - x0) ** 2)
    else:
        loss = torch.mean((v - flow.velocity_target(x0, noise)) ** 2)
    return loss, {"sigma": sigma}


def init(run_key: torch.Tensor, model: Model, tx: optim.GradientTransformation, *,
         with_ema: bool = False) -> TrainState:
    """The initial state: the model's initial params (loaded or drawn), a fresh optimizer state, step 0, and with
    ``with_ema`` an EMA copy of the params."""
    params_key, steps_key = random.split(run_key)
    params = model.initial_params(params_key)
    trained = model.trainable(params)
    role = RoleState(params=params, opt_state=tx.init(trained), ema=ema.ema_init(trained) if with_ema else None)
    return TrainState(step=torch.zeros((), dtype=torch.int64), key=steps_key, roles={ROLE: role})


def validate(state: TrainState, config: validation.ValidationConfig, *, model: Model) -> list[validation.Sampler]:
    """The model to sample at a validation: the EMA params when kept, else the params, on the many-step ODE."""
    role = state.roles[ROLE]
    sigmas = validation.many_step_sigmas(config.num_steps, config.flow_shift)
    params = role.params if role.ema is None else with_trained(role.params, role.ema)
    return [validation.Sampler("model" if role.ema is None else "model_ema", model.apply, params, sigmas, "ode")]


def with_trained(params: dict, trained: dict) -> dict:
    """``params`` with the trained ones replaced by ``trained`` (an EMA, or the differentiated leaves)."""
    return trained if len(trained) == len(params) else {**params, **trained}


def micro_batches(batch: Batch, n: int) -> list[dict[str, Any]]:
    """``batch`` cut into ``n`` equal micro-batches along dim 0 (tensors and lists alike)."""
    size = len(batch["sample_index"])
    if size % n:
        raise ValueError(f"grad_accum = {n} does not divide this rank's batch of {size} samples")
    if n == 1:
        return [dict(batch)]
    m = size // n
    return [_rows(batch, slice(i * m, (i + 1) * m)) for i in range(n)]


def _rows(value: Any, rows: slice) -> Any:
    """Rows ``rows`` of a batch entry: tensors and lists sliced, dicts (the cond) entry by entry."""
    if isinstance(value, Mapping):
        return {k: _rows(v, rows) for k, v in value.items()}
    return value[rows]


def step_(state: TrainState, batch: Batch, *, model: Model, config: Finetune, tx: optim.GradientTransformation,
          lr, group: sharding.Group = sharding.Group()) -> tuple[TrainState, Metrics]:
    """One optimizer step over ``config.grad_accum`` micro-batches, donating ``state`` (see fvx.state.Program).

    Metrics: ``loss`` (mean over micro-batches and ranks), ``grad_norm`` (before clipping), ``lr`` (of this update).
    A non-finite loss or gradient applies nothing and adds ``nonfinite = 1`` (see fvx.state.skipped); every rank
    decides alike, from the rank-mean loss and the global norm.
    """
    key = random.fold_in(state.key, state.step)
    role = state.roles[ROLE]
    trained = model.trainable(role.params)

    def trained_loss(trained: dict, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_fn(with_trained(role.params, trained), micro, key, model=model, config=config)

    value_and_grad = grad.value_and_grad(trained_loss, has_aux=True)
    losses, grads = [], None
    for micro in micro_batches(batch, config.grad_accum):
        (loss, _), g = value_and_grad(trained, micro)
        losses.append(loss)
        grads = g if grads is None else optim.apply_updates_(grads, g)
    if config.grad_accum > 1:
        torch._foreach_mul_(tree.tensor_leaves(grads), 1.0 / config.grad_accum)
    grad_norm = tree.global_norm(grads) if group.dp_size == 1 else sharding.global_norm_sharded(grads, group)
    metrics = {"loss": sharding.dp_mean(torch.stack(losses).mean(), group), "grad_norm": grad_norm,
               "lr": torch.as_tensor(lr(state.step), dtype=torch.float32)}
    if not all_finite(metrics["loss"], metrics["grad_norm"]):
        return skipped(state, metrics)
    trained, opt_state = optim.step_(tx, trained, grads, role.opt_state)  # in place: role.params sees it
    if role.ema is not None:  # EMA after step s counts s + 1 updates; it starts as a copy at max(start, 1)
        ema.ema_step_(role.ema, trained, int(state.step) + 1, decay=config.ema_decay,
                      start_step=max(config.ema_start_step, 1))
    roles = {**state.roles, ROLE: role._replace(opt_state=opt_state)}
    return TrainState(step=state.step + 1, key=state.key, roles=roles), metrics
