"""Callbacks: functions of the run's lifecycle that an experiment composes (``Experiment.callbacks``), the third
factor of FastVideo's ``Trainer = Method x Model x Callbacks x Config``.

A :class:`Callback` is a name and up to six hooks. Each hook reads a :class:`Context` (the state, the last step's
metrics, the tracker to log scalars, images and videos with) and returns nothing: it must not change the state or
the metrics, which the run goes on with. ``on_before_optimizer_step(role, grads, params)`` runs inside a step, after
a role's gradients are clipped and before its optimizer step (methods call it through their ``before_update``).
Validation is one callback (``fvx.training.validation.callback``). A hook that raises stops the run with a
:class:`CallbackError` naming the callback and the hook; checkpoints already saved are complete and stay as they
are.
"""
from __future__ import annotations

import pathlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

HOOKS = ("on_train_start", "on_step_end", "on_before_optimizer_step", "on_validation_begin", "on_validation_end",
         "on_train_end")


class Context(NamedTuple):
    """What a hook sees: ``step`` (updates done so far: the state's step), the state and the frozen roles' params
    (read only), the metrics of the step just taken (floats; empty before the first), the tracker and the run
    folder."""

    step: int
    state: Any
    frozen: Mapping[str, Any]
    metrics: Mapping[str, float]
    tracker: Any
    output_dir: pathlib.Path


Hook = Callable[[Context], None]


class Callback(NamedTuple):
    """A named set of lifecycle hooks (None: not used); see the module docstring."""

    name: str
    on_train_start: Hook | None = None
    on_step_end: Hook | None = None
    on_before_optimizer_step: Callable[[str, Any, Any], None] | None = None
    on_validation_begin: Hook | None = None
    on_validation_end: Hook | None = None
    on_train_end: Hook | None = None


class CallbackError(RuntimeError):
    """A callback's hook raised; the message names both."""


def check(callbacks: Sequence[Callback]) -> tuple[Callback, ...]:
    """``callbacks`` as a tuple, or a ValueError naming an entry that is not a Callback or a repeated name."""
    callbacks = tuple(callbacks)
    for i, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise ValueError(f"Experiment.callbacks()[{i}] is a {type(callback).__name__}, not an "
                             "fvx.training.callbacks.Callback")
    names = [c.name for c in callbacks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"callback names must be unique; repeated: {', '.join(repeated)}")
    return callbacks


def call(callbacks: Sequence[Callback], hook: str, *args: Any) -> None:
    """Run ``hook`` of every callback that has it, in order; a raise becomes a :class:`CallbackError`."""
    for callback in callbacks:
        fn = getattr(callback, hook)
        if fn is None:
            continue
        try:
            fn(*args)
        except CallbackError:
            raise
        except Exception as error:
            raise CallbackError(f"callback {callback.name!r} raised in {hook}: {type(error).__name__}: {error}") \
                from error


def before_update(callbacks: Sequence[Callback]) -> Callable[[str, Any, Any], None] | None:
    """The methods' ``before_update(role, grads, params)`` running every ``on_before_optimizer_step``, or None."""
    if not any(c.on_before_optimizer_step for c in callbacks):
        return None
    return lambda role, grads, params: call(callbacks, "on_before_optimizer_step", role, grads, params)
