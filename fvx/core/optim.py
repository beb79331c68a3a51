"""Optimizers as optax-style gradient transformations, computed with batched ``torch._foreach_*`` kernels.

A ``GradientTransformation`` is ``init(params) -> state`` and ``update(updates, state, params=None) -> (updates,
state)``, both pure, plus ``update_``, the donating twin that computes the same thing in place, and optionally
``apply_``, which also applies the update to the params in place. States are pytrees (NamedTuples, tuples, dicts) of
tensors only, so they checkpoint as they are. Small transformations compose with :func:`chain`, as in optax::

    adamw(lr) == chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))

The count lives in the state: :func:`scale_by_adam`'s for its bias corrections, :func:`scale_by_learning_rate`'s for
the schedule, which it evaluates on the number of updates applied so far (:func:`get_count` reads it,
:func:`learning_rate` gives the lr the next update applies). The schedule is held once, by that transformation.

Pure path (tests, debugging)::

    tx = adamw(cosine(1e-4, warmup_steps=100, total_steps=1000), weight_decay=0.01)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

Donating path (training; compile it with ``torch.compile(functools.partial(step_, tx))``)::

    params, state = step_(tx, params, grads, state)

Donation contract (JAX's ``donate_argnums``, spelled with a trailing underscore):

- ``update_(updates, state, params)`` takes ``updates`` and ``state`` over: it updates ``state``'s tensors in place
  and writes the new updates into ``updates``' buffers, returning ``(updates, state)`` (the same tensors). ``params``
  is only read.
- ``apply_updates_(params, updates)`` adds ``updates`` into ``params`` in place and returns ``params``.
- ``apply_(updates, state, params)`` (optional) takes all three over and updates ``params`` and ``state`` in place,
  returning ``(params, state)``; ``updates``' buffers are its scratch space (garbage afterwards).
- ``step_(tx, params, grads, state)`` does both (``tx.apply_`` when there is one, else ``update_`` then
  ``apply_updates_``): afterwards ``params`` and ``state`` hold the new values (and are returned), and ``grads``'
  buffers are garbage to the caller.
- Donated tensors must not alias each other or ``params``, and must not be read by anyone else meanwhile (an async
  checkpoint save of ``state`` or ``params`` must finish first).

The pure ``update`` is ``update_`` run on copies, so those two agree bit for bit in eager mode. :func:`adamw`'s
``apply_`` (what ``step_`` runs: the fast path) fuses its chain into ``torch.optim.AdamW``'s arithmetic: decay the
params, then ``addcdiv_`` straight into them (10 foreach kernels, against 13 for writing the update out and adding
it); it agrees with the pure path to float rounding, not bit for bit. Learning rates and bias corrections are
computed from the counts as 0-dim tensors, so a compiled step sees them as data and does not recompile as they
change.

A ``None`` leaf in ``updates`` is a zero update that costs nothing, like a parameter whose ``.grad`` is ``None`` in
``torch.optim``: transformations skip it and ``apply_updates`` leaves that parameter as it is.

Parameter groups, as optax: ``masked(tx, mask)`` applies ``tx`` to the leaves ``mask`` selects and passes the others
through unchanged, so ``chain(masked(adamw(1e-1), m), masked(adamw(1e-2), not_m))`` trains two groups with their
own learning rates; ``multi_transform({label: tx}, labels)`` does the same from one label per leaf.
``add_decayed_weights``' ``mask`` decays only the leaves it selects. The state types are registered as safe for
``torch.load(weights_only=True)``, so an optimizer state round-trips through ``torch.save``. Gradient clipping is
not a transformation here: a role clips by the global norm it measures once (``fvx.core.role``).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from fvx.core import tree
from fvx.core.tree import combine, map_tensors, Mask, partition, tensor_leaves, zeros_like

Params = Any  # a pytree of tensors
Updates = Any  # a pytree of tensors (or None holes) with the structure of Params
State = Any  # a pytree of tensors
UpdateFn = Callable[[Updates, State, Optional[Params]], "tuple[Updates, State]"]
ApplyFn = Callable[[Updates, State, Params], "tuple[Params, State]"]
LearningRate = Union[float, Callable[[torch.Tensor], torch.Tensor]]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params=None) -> (updates, state)`` (pure); and
    ``update_``, the same update donating ``updates`` and ``state`` (see the module docstring). A transformation
    written with only a pure ``update`` may leave ``update_`` as None; ``chain``, ``masked`` and ``step_`` then run
    the pure update and copy the new state into the old one. ``apply_``, when not None, is the fused donating step
    ``(updates, state, params) -> (params, state)`` that ``step_`` prefers. ``learning_rate``, when not None, reads
    the learning rate the next update applies from the transformation's state (:func:`learning_rate`)."""

    init: Callable[[Params], State]
    update: UpdateFn
    update_: Optional[UpdateFn] = None
    apply_: Optional[ApplyFn] = None
    learning_rate: Optional[Callable[[State], Any]] = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class ScaleByAdamState(NamedTuple):
    """count: 0-dim int64, updates so far (for the bias corrections); mu, nu: first and second moments, shaped like
    the params."""

    count: torch.Tensor
    mu: Updates
    nu: Updates


class ScaleByScheduleState(NamedTuple):
    """count: 0-dim int64, updates applied so far: the step a learning-rate schedule is evaluated on."""

    count: torch.Tensor


class MaskedState(NamedTuple):
    """The inner transformation's state, with ``None`` at masked-out leaves."""

    inner_state: State


class MultiTransformState(NamedTuple):
    """Each label's transformation state (over its leaves, ``None`` elsewhere), by label."""

    inner_states: dict


torch.serialization.add_safe_globals([EmptyState, ScaleByAdamState, ScaleByScheduleState, MaskedState,
                                      MultiTransformState])


# ---------------------------------------------------------------------------------------------------------------------
# Plumbing


def _from_donating(init: Callable[[Params], State], update_: UpdateFn, apply_: Optional[ApplyFn] = None,
                   learning_rate: Optional[Callable[[State], Any]] = None) -> GradientTransformation:
    """A transformation whose pure ``update`` runs ``update_`` on copies of the updates and the state."""

    def update(updates: Updates, state: State, params: Params = None) -> tuple[Updates, State]:
        return update_(map_tensors(torch.clone, updates), map_tensors(torch.clone, state), params)

    return GradientTransformation(init, update, update_, apply_, learning_rate)


def _donating_update(tx: GradientTransformation, updates: Updates, state: State, params: Params):
    """``tx.update_`` if it has one, else its pure update with the new state copied into ``state``."""
    if tx.update_ is not None:
        return tx.update_(updates, state, params)
    updates, new_state = tx.update(updates, state, params)
    old, new = tensor_leaves(state), tensor_leaves(new_state)
    if len(old) != len(new):
        raise ValueError(f"update returned a state with {len(new)} tensors for one with {len(old)}")
    if old:
        torch._foreach_copy_(old, new)
    return updates, state


def _aligned(updates: Updates, **trees: Any) -> tuple[list[torch.Tensor], ...]:
    """The tensor leaves of ``updates`` and, position by position, of each of ``trees`` (same structure); positions
    where the update is ``None`` are left out. Flattening only: the arithmetic runs on the returned lists."""
    leaves, spec = tree.flatten(updates, none_is_leaf=True)
    keep = [i for i, u in enumerate(leaves) if isinstance(u, torch.Tensor)]
    out = [[leaves[i] for i in keep]]
    for name, other in trees.items():
        try:
            others = spec.flatten_up_to(other)
        except ValueError as e:
            raise ValueError(f"{name} does not have the structure of the updates: {e}") from None
        chosen = [others[i] for i in keep]
        if not all(isinstance(x, torch.Tensor) for x in chosen):
            raise ValueError(f"{name} has no tensor for some leaf that has an update (masked out at init?)")
        out.append(chosen)
    return tuple(out)


def _check_real(name: str, value, *, low: float, high: float | None = None, open_high: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < low or (high is not None and (value >= high if open_high else value > high)):
        bound = "" if high is None else f" and {'<' if open_high else '<='} {high}"
        raise ValueError(f"{name} must be >= {low}{bound}, got {value!r}")
    return float(value)


def _sqrt(x: Union[float, torch.Tensor]) -> Union[float, torch.Tensor]:
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else math.sqrt(x)


def _one_minus_pow(b: float, t: torch.Tensor) -> Union[float, torch.Tensor]:
    """1 - b**t for t >= 1, as -expm1(t log b): accurate in float32 even for b = 0.999 (1 - b is exact-ish)."""
    return 1.0 if b == 0.0 else -torch.expm1(t * math.log(b))


def _count_zero(params: Params) -> torch.Tensor:
    """A 0-dim int64 zero on the first param's device: a fresh update count."""
    leaves = tensor_leaves(params)
    return torch.zeros((), dtype=torch.int64, device=leaves[0].device if leaves else None)


def _mask_flags(mask: Mask, updates: Updates, params: Params = None) -> list[bool]:
    """One bool per tensor leaf of ``updates`` (in ``_aligned``'s order): ``mask`` (a prefix pytree, or a function of
    the params, else of the updates) broadcast over the tree; None selects every leaf."""
    leaves, spec = tree.flatten(updates, none_is_leaf=True)
    if mask is None:
        return [True for leaf in leaves if isinstance(leaf, torch.Tensor)]
    resolved = mask(updates if params is None else params) if callable(mask) else mask
    flags = spec.flatten_up_to(tree.broadcast_prefix(resolved, updates))
    return [bool(f) for f, leaf in zip(flags, leaves) if isinstance(leaf, torch.Tensor)]


# ---------------------------------------------------------------------------------------------------------------------
# Transformations


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)``, with ``torch.optim.Adam``'s moment kernels and bias
    corrections ``1 - b**t`` (``t`` the update's number, from the state's count). Moments take each param's shape,
    dtype and device."""
    b1 = _check_real("b1", b1, low=0.0, high=1.0, open_high=True)
    b2 = _check_real("b2", b2, low=0.0, high=1.0, open_high=True)
    eps = _check_real("eps", eps, low=0.0)

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=_count_zero(params), mu=zeros_like(params), nu=zeros_like(params))

    def update_(updates: Updates, state: ScaleByAdamState, params: Params = None):
        grads, mu, nu = _aligned(updates, mu=state.mu, nu=state.nu)
        bc1, bc2 = _bias_corrections(b1, b2, state.count)
        if grads:  # the grads' buffers end up holding the direction: 1 / denominator -> * mu -> / bc1
            _moments_and_denominator_(grads, mu, nu, b1, b2, eps, bc2)
            torch._foreach_reciprocal_(grads)
            torch._foreach_mul_(grads, mu)
            torch._foreach_div_(grads, bc1)
        state.count.add_(1)
        return updates, state

    return _from_donating(init, update_)


def _bias_corrections(b1: float, b2: float, count: torch.Tensor):
    """``1 - b1**t`` and ``1 - b2**t`` of the update after ``count`` updates (``t = count + 1``)."""
    t = (count + 1).to(torch.float32)
    return _one_minus_pow(b1, t), _one_minus_pow(b2, t)


def _moments_and_denominator_(grads: list, mu: list, nu: list, b1: float, b2: float, eps: float, bc2) -> None:
    """Update the moments in place (torch's kernels: lerp_, mul_, addcmul_), then overwrite the grads' buffers with
    the denominator sqrt(nu) / sqrt(bc2) + eps."""
    torch._foreach_lerp_(mu, grads, 1.0 - b1)
    torch._foreach_mul_(nu, b2)
    torch._foreach_addcmul_(nu, grads, grads, value=1.0 - b2)
    torch._foreach_copy_(grads, nu)
    torch._foreach_sqrt_(grads)
    torch._foreach_div_(grads, _sqrt(bc2))
    torch._foreach_add_(grads, eps)


def add_decayed_weights(weight_decay: float = 0.0, mask: Mask = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on the leaves ``mask`` selects (a pytree of bools, or a function of the
    params returning one; None: every leaf), the others unchanged: decoupled weight decay once scaled by the lr.
    Stateless; needs ``params`` when ``weight_decay > 0``."""
    weight_decay = _check_real("weight_decay", weight_decay, low=0.0)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update_(updates: Updates, state: EmptyState, params: Params = None):
        if not weight_decay:
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights with weight_decay > 0 needs params in update")
        decaying, p = _decayed(mask, updates, params)
        if decaying:
            torch._foreach_add_(decaying, p, alpha=weight_decay)
        return updates, state

    return _from_donating(init, update_)


def _decayed(mask: Mask, updates: Updates, params: Params) -> tuple[list, list]:
    """(the update buffers, the params) of the leaves ``mask`` decays, position by position."""
    (grads, p), flags = _aligned(updates, params=params), _mask_flags(mask, updates, params)
    return [g for g, f in zip(grads, flags) if f], [x for x, f in zip(p, flags) if f]


def scale_by_learning_rate(learning_rate: LearningRate) -> GradientTransformation:
    """``-lr * updates``, with ``lr = learning_rate(count)`` for a schedule (``count`` the updates applied before
    this one, a 0-dim int64 tensor in the state) or the float itself; the count is kept either way."""
    if not callable(learning_rate):
        learning_rate = _check_real("learning_rate", learning_rate, low=0.0)

    def lr_at(state: ScaleByScheduleState):
        return learning_rate(state.count) if callable(learning_rate) else learning_rate

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_count_zero(params))

    def update_(updates: Updates, state: ScaleByScheduleState, params: Params = None):
        (grads,) = _aligned(updates)
        if grads:
            torch._foreach_mul_(grads, -lr_at(state))
        state.count.add_(1)
        return updates, state

    return _from_donating(init, update_, learning_rate=lr_at)


def adamw(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW`` computes it: ``chain(scale_by_adam(b1, b2, eps),
    add_decayed_weights(weight_decay, weight_decay_mask), scale_by_learning_rate(learning_rate))``, i.e. the update
    ``-lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)``, with a fused ``apply_`` (the fast path ``step_`` takes) that
    runs torch's kernels on the chain's state: ``p *= 1 - lr * wd``, then ``p += -lr / bc1 * mu / denominator``.
    ``weight_decay_mask`` (a pytree of bools, or a function of the params returning one; None: every leaf) selects
    the params that decay (e.g. not the norms and biases)."""
    composed = chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, weight_decay_mask),
                     scale_by_learning_rate(learning_rate))
    b1, b2, eps = float(b1), float(b2), float(eps)
    weight_decay = float(weight_decay)

    def apply_(updates: Updates, state: tuple, params: Params) -> tuple[Params, tuple]:
        """torch.optim.AdamW's step in place on the chain's state ``(adam, decay, schedule)``, with the denominator
        in the grads' buffers; allocates nothing param-sized."""
        if params is None:
            raise ValueError("adamw's apply_ needs params")
        adam, _, scheduled = state
        grads, mu, nu, p = _aligned(updates, mu=adam.mu, nu=adam.nu, params=params)
        lr = composed.learning_rate(state)
        bc1, bc2 = _bias_corrections(b1, b2, adam.count)
        if grads:
            _moments_and_denominator_(grads, mu, nu, b1, b2, eps, bc2)
            if weight_decay:
                _, decaying = _decayed(weight_decay_mask, updates, params)
                if decaying:
                    torch._foreach_mul_(decaying, 1.0 - lr * weight_decay)
            if isinstance(lr, torch.Tensor) or isinstance(bc1, torch.Tensor):
                # foreach addcdiv_ takes no 0-dim tensor as its value: fold -lr / bc1 into the denominator (torch's
                # capturable AdamW does the same). lr = 0 makes it -inf and the update -0: the params stay put.
                torch._foreach_mul_(grads, -bc1 / lr)
                torch._foreach_addcdiv_(p, mu, grads)
            else:
                torch._foreach_addcdiv_(p, mu, grads, value=-lr / bc1)
        adam.count.add_(1)
        scheduled.count.add_(1)
        return params, state

    return composed._replace(apply_=apply_)


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply ``txs`` in order, each to the updates of the one before; the state is the tuple of their states. The
    chain's learning rate is that of its one member that has one (none when several do)."""
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain argument {i} is not a GradientTransformation: {tx!r}")

    def init(params: Params) -> tuple:
        return tuple(tx.init(params) for tx in txs)

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise ValueError(f"chain of {len(txs)} transformations got a state that is not a tuple of {len(txs)}")

    def run_(chosen: tuple, updates: Updates, states: tuple, params: Params) -> tuple[Updates, tuple]:
        new_states = []
        for tx, s in zip(chosen, states):
            updates, s = _donating_update(tx, updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    def update_(updates: Updates, state: tuple, params: Params = None) -> tuple[Updates, tuple]:
        check(state)
        return run_(txs, updates, state, params)

    def apply_(updates: Updates, state: tuple, params: Params) -> tuple[Params, tuple]:
        """All but the last transformation's ``update_``, then the last one's fused ``apply_``."""
        check(state)
        updates, head = run_(txs[:-1], updates, state[:-1], params)
        params, last = txs[-1].apply_(updates, state[-1], params)
        return params, (*head, last)

    readers = [(i, tx.learning_rate) for i, tx in enumerate(txs) if tx.learning_rate is not None]
    learning_rate = None
    if len(readers) == 1:
        index, reader = readers[0]
        learning_rate = lambda state: reader(state[index])  # noqa: E731
    return _from_donating(init, update_, apply_ if txs and txs[-1].apply_ is not None else None, learning_rate)


def _selects_something(selected: Any, what: str) -> None:
    if not tensor_leaves(selected):
        raise ValueError(f"{what} selects no parameter")


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; the others pass through unchanged, as in optax, and hold no
    state. ``mask`` is a pytree of bools (a prefix of the params is enough) or a function of the params returning one
    (called on ``params`` in update, or on ``updates`` when params are not given). A mask that selects no param is
    an error (at init)."""
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked needs a GradientTransformation, got {inner!r}")

    def init(params: Params) -> MaskedState:
        selected, _ = partition(params, mask)
        _selects_something(selected, "masked: the mask")
        return MaskedState(inner.init(selected))

    def update_(updates: Updates, state: MaskedState, params: Params = None) -> tuple[Updates, MaskedState]:
        full = mask(updates if params is None else params) if callable(mask) else mask
        selected, rest = partition(updates, full)
        selected_params = None if params is None else partition(params, full)[0]
        selected, inner_state = _donating_update(inner, selected, state.inner_state, selected_params)
        return combine(selected, rest), MaskedState(inner_state)

    reader = inner.learning_rate
    return _from_donating(init, update_,
                          learning_rate=None if reader is None else lambda state: reader(state.inner_state))


def multi_transform(transforms: dict[str, GradientTransformation], labels: Any) -> GradientTransformation:
    """A transformation per parameter group (optax's ``multi_transform``, now ``partition``): ``labels`` gives each
    param a label of ``transforms`` (a pytree of strings, a prefix of the params, or a function of the params
    returning one); each label's leaves go through its transformation, with its own state. A param whose label has no
    transformation, or a label that labels no param, is an error (at init) naming it."""
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"multi_transform: transforms[{label!r}] is not a GradientTransformation: {tx!r}")

    def resolved(tree_: Any) -> Any:
        return tree.broadcast_prefix(labels(tree_) if callable(labels) else labels, tree_)

    def groups(tree_: Any, by: Any) -> dict[str, tuple[Any, Any]]:
        return {label: partition(tree_, tree.tree_map(lambda l, label=label: l == label, by))
                for label in transforms}

    def init(params: Params) -> MultiTransformState:
        by = resolved(params)
        unknown = sorted({l for l in tree.leaves(by) if l not in transforms})
        if unknown:
            raise ValueError(f"multi_transform: params are labelled {unknown}, which have no transformation "
                             f"(transformations: {', '.join(transforms)})")
        states = {}
        for label, (selected, _) in groups(params, by).items():
            _selects_something(selected, f"multi_transform: the label {label!r}")
            states[label] = transforms[label].init(selected)
        return MultiTransformState(states)

    def update_(updates: Updates, state: MultiTransformState, params: Params = None) -> tuple[Updates, Any]:
        by = resolved(updates if params is None else params)
        param_groups = None if params is None else groups(params, by)
        outputs, states = [], {}
        for label, (selected, _) in groups(updates, by).items():
            group_params = None if param_groups is None else param_groups[label][0]
            selected, states[label] = _donating_update(transforms[label], selected, state.inner_states[label],
                                                       group_params)
            outputs.append(selected)
        return combine(*outputs), MultiTransformState(states)

    def apply_(updates: Updates, state: MultiTransformState, params: Params) -> tuple[Params, Any]:
        """Each label's fused step on its own leaves, in place (the groups' params share the params' tensors)."""
        by = resolved(params)
        param_groups, states = groups(params, by), {}
        for label, (selected, _) in groups(updates, by).items():
            _, states[label] = step_(transforms[label], param_groups[label][0], selected, state.inner_states[label])
        return params, MultiTransformState(states)

    fused = all(tx.apply_ is not None for tx in transforms.values())
    return _from_donating(init, update_, apply_ if fused else None)


def get_count(state: State) -> torch.Tensor:
    """The number of updates applied so far, read from the (first) learning-rate schedule's state inside an optimizer
    state (big_vision's ``get_count``). A ValueError when the state holds no schedule."""
    found = [node for node in tree.leaves(state, is_leaf=lambda n: isinstance(n, ScaleByScheduleState))
             if isinstance(node, ScaleByScheduleState)]
    if not found:
        raise ValueError("get_count: the optimizer state holds no learning-rate schedule (no update count)")
    return found[0].count


def learning_rate(tx: GradientTransformation, state: State) -> Any:
    """The learning rate the next update of ``tx`` applies, evaluated on its schedule's count in ``state`` (a 0-dim
    tensor for a schedule, else the float). A ValueError when ``tx`` has no single learning rate."""
    if tx.learning_rate is None:
        raise ValueError("learning_rate: the transformation has no single learning rate (none, or one per group)")
    return tx.learning_rate(state)


# ---------------------------------------------------------------------------------------------------------------------
# Applying updates


def apply_updates_(params: Params, updates: Updates) -> Params:
    """``params += updates`` in place (one foreach kernel); ``None`` updates leave their params untouched."""
    u, p = _aligned(updates, params=params)
    if u:
        torch._foreach_add_(p, u)
    return params


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` as new tensors in each param's dtype; params with a ``None`` update are returned as
    they are (the same tensors)."""
    copies = tree.tree_map(lambda p, u: p if u is None else p.clone(), params, updates, none_is_leaf=True)
    return apply_updates_(copies, updates)


def step_(tx: GradientTransformation, params: Params, grads: Params, state: State) -> tuple[Params, State]:
    """One optimizer step in place, donating ``params``, ``grads`` and ``state`` (see the module docstring):
    ``tx.apply_(grads, state, params)`` when ``tx`` has one, else ``updates, state = tx.update_(grads, state,
    params)`` then ``params += updates``. Returns ``(params, state)``, the same tensors, updated. With AdamW it
    allocates no param-sized buffer: ``grads``' buffers are the scratch space."""
    if tx.apply_ is not None:
        return tx.apply_(grads, state, params)
    updates, state = _donating_update(tx, grads, state, params)
    return apply_updates_(params, updates), state
