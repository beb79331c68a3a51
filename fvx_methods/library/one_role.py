"""A method of one trainable role (fine-tuning, DFSFT/TFSFT, KD, causal CD) is its loss: this builds the rest of its
program.

The role ``student`` trains its params (``Model.weights.initial``: all of them, the adapters of a LoRA model, or the
part a family config leaves trainable) with ``fvx.core.role.step_one_`` (step key, gradient accumulation, norm, finite
check, clip, AdamW, EMA; metrics averaged over data-parallel ranks); what the model holds frozen (a LoRA base) is a
frozen argument of the step, never saved, as are frozen roles beside it (a teacher). Keys: ``split(run_key)`` gives
the params' key (which also draws the frozen base and frozen roles) and the steps' key. Validation samples the
student's EMA when kept, else its params, with the base.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Mapping, NamedTuple, Sequence

import msgspec
import torch

from fvx.config import Config
from fvx.core import ema, random, role
from fvx.core.optim_config import AdamWConfig
from fvx.core.state import Batch, HeldRole, NONFINITE, Program, TrainState
from fvx.training import validation
from fvx_models.model import Model, Params

STUDENT = "student"

Samplers = Callable[[Params, bool, validation.ValidationConfig], Sequence[validation.Sampler]]
"""``(the student's whole params, whether they are its EMA, the validation config) -> samplers``."""


class OneRoleConfig(Config):
    """The knobs every one-role method has: the student's optimizer, micro-batches per step (``grad_accum``), and an
    EMA of its params (``ema_decay``, None or 0 for none): ``ema_start`` ``reset``, a copy at update
    ``max(ema_start_step, 1)``, then ``ema <- d ema + (1 - d) params`` after every update; ``blend``, the blend from
    the initial params after every update from ``ema_start_step`` on (``fvx.core.role.RoleOptimizer``); validation
    and ``export --ema`` use it."""

    optim: AdamWConfig = AdamWConfig()
    grad_accum: Annotated[int, msgspec.Meta(ge=1)] = 1
    ema_decay: float | None = None
    ema_start_step: Annotated[int, msgspec.Meta(ge=0)] = 0
    ema_start: ema.Start = "reset"

    def __post_init__(self) -> None:
        if self.optim.lr <= 0:
            raise ValueError(f"{self.name} needs optim.lr > 0, got {self.optim.lr}")
        if self.ema_decay:
            ema.check_decay(self.ema_decay)

    @property
    def name(self) -> str:
        """The method's name in messages."""
        return type(self).__name__

    def held_roles(self) -> tuple[HeldRole, ...]:
        """What the run holds while it trains (the dry run's rows): the student, trainable, with its EMA."""
        return (HeldRole(STUDENT, trainable=True, ema=bool(self.ema_decay)),)


LossInputs = Callable[[TrainState, Any], dict[str, Any]]
"""``(state, frozen) -> keyword arguments of the loss``: what else of the state and the frozen params it reads."""


class Carry(NamedTuple):
    """What a one-role method carries from step to step (the state's ``carry``, checkpointed): ``init(batch)``, its
    fixed-shape tensors at step 0; ``update(carry, stats) -> carry`` after each applied step, from ``stats``: the
    logged metrics named in ``metrics`` (averaged over micro-batches and data-parallel ranks; taken out of the logged
    ones, so they may be vectors). A skipped step keeps the carry."""

    init: Callable[[Batch], Any]
    update: Callable[[Any, dict[str, torch.Tensor]], Any]
    metrics: tuple[str, ...]


def program(config: OneRoleConfig, model: Model, *, total_steps: int, loss: Callable[..., Any],
            check: Callable[[Batch], None], samplers: Samplers, ranks: role.Ranks = role.ONE_PROCESS,
            before_update: role.BeforeUpdate | None = None,
            logged: Callable[[torch.Tensor, dict], dict[str, torch.Tensor]] | None = None,
            data_model: Model | None = None, dataset: Callable[[Any], Any] | None = None,
            frozen_roles: Mapping[str, Model] | None = None, loss_inputs: LossInputs | None = None,
            ema_model: Model | None = None, carry: Carry | None = None) -> Program:
    """The loop's program of a one-role method: ``loss(params, micro_batch, step_key, **loss_inputs(state, frozen))
    -> (loss, aux)`` of the student's ``model``; ``check(batch)`` refuses a first batch that does not fit;
    ``samplers`` says how validation samples the student; ``logged(loss, aux)`` the metrics it logs (default
    ``{"loss": loss}``). ``data_model`` (default ``model``) and ``dataset`` are the program's
    (``fvx.core.state.Program``): where the data comes from. ``frozen_roles`` (role -> model) are held whole and frozen
    beside the student's base (a teacher), drawn from the same key when not loaded; ``ema_model`` (default
    ``model``) gives the params the EMA starts from (:func:`init`); ``carry``: what the method carries across steps
    (:class:`Carry`; ``loss_inputs`` reads it from the state)."""
    opt = config.optim.role(total_steps, ranks, ema_decay=config.ema_decay, ema_start_step=config.ema_start_step,
                            ema_start=config.ema_start)
    extra = {} if logged is None else {"logged": logged}
    held = {STUDENT: (model, False), **{name: (other, True) for name, other in (frozen_roles or {}).items()}}

    def step_(state: TrainState, frozen: Any, batch: Batch):
        inputs, carried = {} if loss_inputs is None else loss_inputs(state, frozen), state.carry
        state, metrics = role.step_one_(state, batch, loss, opt=opt, name=STUDENT, grad_accum=config.grad_accum,
                                        base=frozen.get(STUDENT), before=before_update, **extra, **inputs)
        if carry is None:
            return state, metrics
        stats = {name: metrics.pop(name) for name in carry.metrics}
        applied = not metrics.get(NONFINITE)
        return state._replace(carry=carry.update(carried, stats) if applied else carried), metrics

    def validate(state: TrainState, frozen: Any, validation_config: validation.ValidationConfig):
        student = state.roles[STUDENT]
        trained = student.params if student.ema is None else student.ema
        return samplers(role.with_trained(frozen.get(STUDENT), trained), student.ema is not None, validation_config)

    return Program(model=data_model or model, init=lambda run_key: init(run_key, model, opt, ema_model),
                   frozen=lambda run_key: role.frozen_params(random.split(run_key)[0], held),
                   step_=step_, check=check, validate=validate, **({} if dataset is None else {"dataset": dataset}),
                   **({} if carry is None else {"carry": carry.init}))


def init(run_key: torch.Tensor, model: Model, opt: role.RoleOptimizer, ema_model: Model | None = None) -> TrainState:
    """Step 0: the params the model trains (loaded or drawn from the first half of ``split(run_key)``, which also
    draws its frozen base), a fresh optimizer state and, when kept, an EMA copy (of ``ema_model``'s initial params,
    from the same key, when it is another model of the same trained params); the steps' key is the second."""
    params_key, steps_key = random.split(run_key)
    separate_ema = opt.ema_decay and ema_model is not None and ema_model is not model
    ema_params = ema_model.weights.initial(params_key) if separate_ema else None
    student = role.init(opt, model.weights.initial(params_key), ema_params)
    return TrainState(step=torch.zeros((), dtype=torch.int64), key=steps_key, roles={STUDENT: student})


def check_latents(batch: Batch, model: Model) -> None:
    """A ValueError naming both shapes when the batch has no latents or they do not fit ``model`` (its cond was
    checked when the model made it)."""
    if "latents" not in batch:
        raise ValueError("fine-tuning needs latents, but the batch has none (text_only data?)")
    latents = batch["latents"]
    model.check_latents({name: tuple(x.shape) for name, x in latents.items()} if isinstance(latents, Mapping)
                        else tuple(latents.shape), where="batch latents")


def check_data(batch: Batch, model: Model, grad_accum: int) -> None:
    """:func:`check_latents` and :func:`check_grad_accum`: what a method training on the data's latents checks."""
    check_latents(batch, model)
    check_grad_accum(batch, grad_accum)


def check_grad_accum(batch: Batch, grad_accum: int) -> None:
    """A ValueError when ``method.grad_accum`` does not divide a rank's batch."""
    if len(batch["sample_index"]) % grad_accum:
        raise ValueError(f"method.grad_accum = {grad_accum} does not divide a rank's batch of "
                         f"{len(batch['sample_index'])} samples")


def many_step_samplers(model: Model, draw: Any = None) -> Samplers:
    """Validation of a model trained by flow matching: the many-step ODE (``validation.num_steps``,
    ``validation.flow_shift``) at the validation's classifier-free guidance, tagged ``model`` (``model_ema``);
    ``draw`` samples otherwise (a causal model block by block: ``fvx_models.streaming.draw``)."""
    def samplers(params: Params, is_ema: bool, config: validation.ValidationConfig) -> list[validation.Sampler]:
        sigmas = validation.schedule_sigmas(config, model)
        if model.joint:
            sigmas = model.rules.joint_sigmas(sigmas)
        return [validation.Sampler("model_ema" if is_ema else "model", model.apply, params, sigmas, "ode",
                                   guided=True, draw=validation.many_step_draw(config, model.apply) if draw is None
                                   else draw(sigmas))]
    return samplers
