"""One trainable role's update, shared by every method: gradients -> global norm -> finite check -> clip and optimizer
step -> EMA.

A method computes its losses and gradients, then for each trainable role:

    measured = role.measure(opt, role_state, grads)          # the global norm (once) and the lr of this update
    if not all_finite(loss, measured.norm): return skipped(...)
    role_state = role.update_(opt, role_state, measured, step)   # clip by that norm, AdamW, EMA

and a method of one trainable role (fine-tuning, DFSFT, KD) is its loss under :func:`step_one_`.

The learning rate is the optimizer's, read from its schedule's state (``fvx.core.optim.learning_rate``: the schedule at
the update count, big_vision's ``get_count``), so the logged lr is the applied one also after a skipped step. The clip,
the only one (the optimizer chain has none), scales the gradients by ``min(1, max_grad_norm / (norm + 1e-6))``
(``torch.nn.utils.clip_grad_norm_``'s formula) with the norm the metrics report, computed once. Where a role's numbers
combine over processes is its :class:`Ranks`: the global norm over every rank's shards, and the mean of a per-rank
metric over the data-parallel ranks (one process: :data:`ONE_PROCESS`; a multi-process run's is its mesh's group,
``fvx.distributed.processes.Group``). :func:`accumulate` is gradient accumulation over micro-batches for any loss
(optax's ``MultiSteps`` idea, in one step): the mean of the micro-batches' losses and gradients, which equals the whole
batch's to float rounding when the loss is a mean over samples whose draws come from their global sample index.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Protocol

import torch

from fvx.core import ema, grad, optim, random, tree
from fvx.core.state import all_finite, Metrics, RoleState, skipped, TrainState

Params = Any
BeforeUpdate = Callable[[str, Params, Params], None]  # (role, grads, params): a callback's look before the step


class Ranks(Protocol):
    """The processes a role's numbers combine over (``fvx.distributed.processes.Group`` on a mesh)."""

    def global_norm(self, tree_: Any) -> torch.Tensor:
        """The 2-norm over every rank's shards of ``tree_``, 0-dim fp32."""

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a per-rank metric over the data-parallel ranks."""

    def max(self, value: int) -> int:
        """The largest of a per-rank integer over the data-parallel ranks."""

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's ``value [n, ...]`` concatenated along dim 0 in rank order, on every rank."""


class OneProcess(NamedTuple):
    """The :class:`Ranks` of a single process: nothing to combine."""

    def global_norm(self, tree_: Any) -> torch.Tensor:
        return tree.global_norm(tree_)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def max(self, value: int) -> int:
        return int(value)

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        return value


ONE_PROCESS = OneProcess()


class RoleOptimizer(NamedTuple):
    """How one trainable role updates: its optimizer (without clipping; its learning rate is read from its state),
    the clip threshold (0: none), the :class:`Ranks` its norm and metrics combine over, and its EMA (``ema_decay``
    None: none). The EMA starts as a copy of the initial params; counting updates from 1 (FastVideo's iteration ``it``,
    which is fvx's 0-based ``step + 1``), with ``s = max(ema_start_step, 1)``: ``ema_start="reset"`` re-copies the
    params after update ``s`` and blends ``ema <- d ema + (1 - d) params`` after every later one (FastVideo's
    EMACallback); ``"blend"`` blends after every update ``it >= s``, from the initial copy (FastVideo's causal
    consistency distillation, whose ``it >= ema_start_step`` with ``ema_start_step`` 0 or 1 is every update)."""

    tx: optim.GradientTransformation
    max_grad_norm: float = 0.0
    ranks: Ranks = ONE_PROCESS
    ema_decay: float | None = None
    ema_start_step: int = 0
    ema_start: ema.Start = "reset"


def init(opt: RoleOptimizer, params: Params, ema_params: Params | None = None) -> RoleState:
    """A role's state at step 0: the ``params`` it trains, a fresh optimizer state and an EMA (when kept): a copy of
    ``params``, or ``ema_params`` themselves (the initial weights of another model of the same params)."""
    shadow = None
    if opt.ema_decay:
        shadow = ema.ema_init(params) if ema_params is None else ema_params
    return RoleState(params=params, opt_state=opt.tx.init(params), ema=shadow)


def frozen_params(key: torch.Tensor, roles: Mapping[str, tuple[Any, bool]]) -> dict[str, Params]:
    """Each role's frozen params, ``roles[name] = (model, whole_model)``: a frozen role's whole model (a teacher) or
    a trained role's base (``model.weights.base``), all drawn from ``key`` when not loaded. Made once per distinct
    ``model.weights.base_id`` and shared: a LoRA student, its critic and the teacher they share hold one base in memory.
    Roles with nothing frozen are left out."""
    made: dict[Any, Params] = {}
    out = {}
    for name, (model, whole_model) in roles.items():
        identity = model.weights.base_id(whole_model=whole_model)
        if identity is None:
            continue
        if identity not in made:
            made[identity] = model.weights.base(key, whole_model=whole_model)
        out[name] = made[identity]
    return out


class Measured(NamedTuple):
    """A role's gradients with their global norm (before clipping) and the lr the update will apply."""

    grads: Params
    norm: torch.Tensor
    lr: torch.Tensor


def measure(opt: RoleOptimizer, state: RoleState, grads: Params) -> Measured:
    """The global norm of ``grads`` (one all-reduce when sharded) and the lr of this update, read from the
    optimizer state's schedule."""
    norm = opt.ranks.global_norm(grads)
    lr = torch.as_tensor(optim.learning_rate(opt.tx, state.opt_state), dtype=torch.float32)
    return Measured(grads, norm, lr)


def metrics(measured: Measured, name: str = "") -> Metrics:
    """``grad_norm`` and ``lr`` (``grad_norm/<name>``, ``lr/<name>`` with a name)."""
    suffix = f"/{name}" if name else ""
    return {f"grad_norm{suffix}": measured.norm, f"lr{suffix}": measured.lr}


def update_(opt: RoleOptimizer, state: RoleState, measured: Measured, step: int,
            before: BeforeUpdate | None = None, name: str = "") -> RoleState:
    """Clip ``measured.grads`` by its norm, apply the optimizer to ``state.params`` and step the EMA, all in place
    (donating ``state`` and the gradients); ``step`` is the 0-based step. ``before(name, grads, params)`` sees the
    clipped gradients first (a callback)."""
    if opt.max_grad_norm:
        clip_(measured.grads, measured.norm, opt.max_grad_norm)
    if before is not None:
        before(name, measured.grads, state.params)
    _, opt_state = optim.step_(opt.tx, state.params, measured.grads, state.opt_state)
    return ema_(opt, state._replace(opt_state=opt_state), step)


def clip_(grads: Params, norm: torch.Tensor, max_norm: float) -> Params:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` their global norm: the formula of
    ``torch.nn.utils.clip_grad_norm_`` (it always multiplies, so no host sync)."""
    leaves = tree.tensor_leaves(grads)
    if leaves:
        torch._foreach_mul_(leaves, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return grads


def ema_(opt: RoleOptimizer, state: RoleState, step: int) -> RoleState:
    """The EMA at the end of step ``step`` (it counts ``step + 1`` updates; :class:`RoleOptimizer`), in place;
    nothing without one."""
    if state.ema is not None:
        ema.ema_step_(state.ema, state.params, step + 1, decay=opt.ema_decay, start_step=max(opt.ema_start_step, 1),
                      start=opt.ema_start)
    return state


# ------------------------------------------------------------------------------------------------------ accumulation


def micro_batches(batch: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """``batch`` cut into ``n`` equal micro-batches along dim 0: tensors and lists sliced, dicts (the cond) entry by
    entry."""
    size = len(batch["sample_index"])
    if size % n:
        raise ValueError(f"grad_accum = {n} does not divide this rank's batch of {size} samples")
    if n == 1:
        return [dict(batch)]
    m = size // n
    return [rows(batch, slice(i * m, (i + 1) * m)) for i in range(n)]


def rows(value: Any, part: slice) -> Any:
    """The rows ``part`` (along dim 0) of a tensor, a list, or a dict of them (a cond, a joint model's latents)."""
    if isinstance(value, Mapping):
        return {k: rows(v, part) for k, v in value.items()}
    return value[part]


def accumulate(value_and_grad: Callable[..., Any], params: Params, batch: Mapping[str, Any], n: int, *args: Any,
               **kwargs: Any) -> tuple[tuple[torch.Tensor, dict], Params]:
    """``((loss, aux), grads)`` of ``value_and_grad(params, micro_batch, *args, **kwargs)`` (from
    ``fvx.core.grad.value_and_grad(..., has_aux=True)``) averaged over ``n`` micro-batches of ``batch``; the gradients
    are summed in place, so one gradient buffer lives at a time. ``aux`` holds the micro-batches' mean of each
    entry."""
    losses, auxes, grads = [], [], None
    for micro in micro_batches(batch, n):
        (loss, aux), g = value_and_grad(params, micro, *args, **kwargs)
        losses.append(loss)
        auxes.append(aux)
        grads = g if grads is None else optim.apply_updates_(grads, g)
    if n == 1:
        return (losses[0], auxes[0]), grads
    torch._foreach_mul_(tree.tensor_leaves(grads), 1.0 / n)
    aux = {name: torch.stack([a[name] for a in auxes]).mean(0) for name in auxes[0]}
    return (torch.stack(losses).mean(), aux), grads


def with_trained(base: Params | None, trained: Params) -> Params:
    """The params a model applies: its frozen ``base`` (None or empty: none) and the ``trained`` ones (the role's
    params, its EMA, or the differentiated leaves) in one flat dict."""
    return trained if not base else {**base, **trained}


def grads(loss: Callable[..., Any], base: Params | None, trained: Params, batch: Mapping[str, Any], n: int,
          *args: Any, **kwargs: Any) -> tuple[tuple[torch.Tensor, dict], Params]:
    """``((loss, aux), grads)`` of ``loss(with_trained(base, trained), micro_batch, *args, **kwargs)`` over ``n``
    micro-batches (:func:`accumulate`), differentiated in ``trained`` only (the params a role trains)."""
    def of_trained(trained: Params, micro: Mapping[str, Any], *rest: Any, **kw: Any):
        return loss(with_trained(base, trained), micro, *rest, **kw)

    return accumulate(grad.value_and_grad(of_trained, has_aux=True), trained, batch, n, *args, **kwargs)


def step_one_(state: TrainState, batch: Mapping[str, Any], loss: Callable[..., Any], *, opt: RoleOptimizer, name: str,
              grad_accum: int = 1, base: Params | None = None, before: BeforeUpdate | None = None,
              logged: Callable[[torch.Tensor, dict], Metrics] = lambda loss, aux: {"loss": loss},
              **loss_kwargs: Any) -> tuple[TrainState, Metrics]:
    """One optimizer step of the one trainable role ``name``, donating ``state``: ``loss(params, micro_batch,
    step_key, **loss_kwargs) -> (loss, aux)`` over ``grad_accum`` micro-batches with the step key
    ``fold_in(state.key, state.step)``, then :func:`measure` and :func:`update_`. Metrics: ``logged(loss, aux)``
    (its first entry the loss checked for finiteness; each averaged over data-parallel ranks), ``grad_norm`` and
    ``lr``; a non-finite loss or gradient applies nothing (``fvx.core.state.skipped``)."""
    key = random.fold_in(state.key, state.step)
    trained = state.roles[name]
    (value, aux), grads_ = grads(loss, base, trained.params, batch, grad_accum, key, **loss_kwargs)
    measured = measure(opt, trained, grads_)
    values = {metric: opt.ranks.mean(v) for metric, v in logged(value, aux).items()}
    out = {**values, **metrics(measured)}
    if not all_finite(next(iter(values.values())), measured.norm):
        return skipped(state, out)
    trained = update_(opt, trained, measured, int(state.step), before, name)
    return state._replace(step=state.step + 1, roles={**state.roles, name: trained}), out
