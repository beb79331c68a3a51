"""How a method's training state is laid out, and the pair of functions a method hands the loop.

The state is a pytree of tensors only, so it checkpoints as it is: the step, the run key, per trainable role its
params, optimizer state and (where used) EMA params, and what the method carries from one step to the next (``carry``:
a stream's cache and latents, made by older weights, so not recomputable from the run key; None for most methods).
Frozen roles (a teacher) are not in it: they are arguments of the step (:data:`Frozen`). Keys derive from the run key
and the step, so nothing about RNG needs saving.

Non-finite steps. A step whose loss or gradients are not finite must not touch the state (its updates run in place,
so the check comes before them): the method returns :func:`skipped` instead, the state with only its step advanced
and ``metrics[NONFINITE] = 1``. The loop then halts or goes on, as ``run.on_nonfinite`` says.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from fvx.core import tree


class RoleState(NamedTuple):
    """One trainable role: params (flat dict keyed like the diffusers state_dict), optimizer state, EMA or None."""

    params: dict[str, torch.Tensor]
    opt_state: Any
    ema: dict[str, torch.Tensor] | None = None


class TrainState(NamedTuple):
    """step: 0-dim int64, steps taken; key: the run key, int64 [2]; roles: trainable role name -> RoleState; carry:
    the method's carried state (:attr:`Program.carry`), a pytree of fixed-shape tensors, or None."""

    step: torch.Tensor
    key: torch.Tensor
    roles: dict[str, RoleState]
    carry: Any = None


Batch = Mapping[str, Any]
Metrics = dict[str, torch.Tensor]

NONFINITE = "nonfinite"
"""The metric a step reports (as 1) when it found a non-finite loss or gradient and applied no update."""


class HeldRole(NamedTuple):
    """What a method holds of one of its roles while it trains (the dry run's rows): whether the role trains (its
    params, gradients and optimizer state, in fp32) or is frozen (its whole model, in its frozen dtype), and whether
    it keeps an EMA; ``optimizer=False``: a trained role's params alone, moved by the method, without gradients or
    optimizer state (an RL method's old policy); ``model``: the role whose model it is (default: its own). The first
    role is the one the data feeds."""

    name: str
    trainable: bool
    ema: bool = False
    optimizer: bool = True
    model: str | None = None


Frozen = Mapping[str, Any]  # frozen role name -> its params (a teacher): arguments of the step, never saved


class Program(NamedTuple):
    """What a method gives the loop, built from its role -> model mapping:

    model                                   the model the data feeds: its latent space and conditioning (the student)
    init(run_key) -> state                  step 0's trainable state
    frozen(run_key) -> {role: params}       the frozen roles' params (a teacher), made once by the loop before the
                                            first step and passed to every step; never saved
    step_(state, frozen, batch)             one step, donating ``state`` (JAX's donation: it may update the state's
                                            tensors in place, and the caller must use only the state it returns);
                                            :func:`step` gives the pure version
    check(batch)                            raises a clear error when a batch does not fit (called once before the
                                            first step)
    validate(state, frozen, config)         the models to sample at a validation (a list of
                                            ``fvx.training.validation.Sampler``)
    dataset(dataset) -> dataset             the data the steps read, made from the experiment's dataset when the
                                            loop opens it (default: that dataset itself; a method that trains on
                                            data it made beforehand, such as a cache of a teacher's samples, reads
                                            that instead); a ValueError refuses the run before anything is written
    carry(batch) -> carry                   what the method carries across steps, as it starts (the state's
                                            ``carry``): fixed-shape tensors made from the first batch's shapes, so a
                                            checkpoint restores into it; on a mesh, per-sample tensors are this
                                            rank's rows (``fvx.distributed.sharding.Shards`` along dim 0). Default:
                                            None (nothing carried)
    batch_at(dataset, data_key, step, *, batch_size, rank, world) -> raw batch
                                            how step ``step`` reads this rank's data, a pure function of its
                                            arguments; None: ``fvx.data.batching.batch_at`` (an epoch's shuffled
                                            order). A method that samples its own prompts (RL's K-repeat
                                            groups) sets it
    """

    model: Any
    init: Callable[[torch.Tensor], TrainState]
    step_: Callable[[TrainState, Frozen, Batch], tuple[TrainState, Metrics]]
    frozen: Callable[[torch.Tensor], dict[str, Any]] = lambda run_key: {}
    check: Callable[[Batch], None] = lambda batch: None
    validate: Callable[[TrainState, Frozen, Any], Sequence[Any]] = lambda state, frozen, config: ()
    dataset: Callable[[Any], Any] = lambda dataset: dataset
    carry: Callable[[Batch], Any] = lambda batch: None
    batch_at: Callable[..., dict] | None = None


def copy(state: Any) -> Any:
    """A copy of every tensor of ``state`` (to keep a state that a donating step will consume)."""
    return tree.map_tensors(torch.clone, state)


def step(program: Program, state: TrainState, frozen: Frozen, batch: Batch) -> tuple[TrainState, Metrics]:
    """``program.step_`` on a copy of ``state``: pure, at the cost of one copy of the state."""
    return program.step_(copy(state), frozen, batch)


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of ``tensors`` is finite (one host sync). Call it on the loss and the gradient norm
    before a donating optimizer update: a NaN or Inf in any gradient makes the norm non-finite."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def skipped(state: TrainState, metrics: Metrics) -> tuple[TrainState, Metrics]:
    """What a step returns when it applies no update: ``state`` with its step advanced, ``metrics`` flagged."""
    flag = torch.ones((), dtype=torch.float32)
    return state._replace(step=state.step + 1), {**metrics, NONFINITE: flag}
