"""How blocks are compiled (design §3): the units of a model (its transformer blocks) come in named *groups* of one
structure each (Wan has one, ``blocks``; HunyuanVideo three: its dual- and single-stream blocks and the token
refiner's). Every unit of a group runs through one function over one meta *template* unit of that group, shared by
all its units through ``functional_call``, so one compiled graph serves every block of a group.

``install_units(module, {"blocks": ["blocks.0.", "blocks.1.", ...]}, mode=...)`` routes each unit's ``forward`` to
``fn(unit_params, unit_buffers, *args)``, the params being whatever the unit holds at call time (under an enclosing
``functional_call``, the caller's tensors). With sharded params, ``gather(prefix, unit_params, compute)``
(``fvx.distributed.gather_schedule.UnitGathers``) runs first, eagerly: it gathers the unit's shards and calls ``fn`` on
the full params through ``compute``, so its collectives can be issued ahead of the unit that uses them. With
``mode="blocks"`` ``fn`` is ``torch.compile(fullgraph=True, dynamic=False)``'d: shapes are static by construction and
every rank compiles the same graph; the root, the gathers and the activation checkpoint (``fvx.core.grad.remat``, which
wraps the routed unit) stay eager. Compiled code sees plain tensors only. ``mode="model"`` instead compiles the whole
forward as one graph (:func:`whole_function`; one process).

Each compiled graph is counted per group in a :class:`CompileStats` (by a wrapper around the backend) and logged on the
``fvx.distributed.compile`` logger, so a test or a run can hold the count at one graph per group and input signature.
"""
from __future__ import annotations

import copy
import functools
import logging
import types
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from fvx.core import functional

Mode = Literal["none", "blocks", "model"]
MODES: tuple[str, ...] = ("none", "blocks", "model")
UnitFn = Callable[..., Any]  # fn(params, buffers, *args, **kwargs), params/buffers keyed relative to the unit

_ROUTED = "fvx_units"  # the attribute holding the unit prefixes routed in a module

log = logging.getLogger("fvx.distributed.compile")


class CompileStats:
    """The graphs torch.compile built for the installed functions, per unit group, one input signature each: grad
    mode and the (shape, dtype) of every tensor input. ``recompiles`` counts graphs beyond one per distinct
    signature of a group."""

    def __init__(self) -> None:
        self.signatures: dict[str, list[tuple]] = {}

    def record(self, group: str, signature: tuple) -> None:
        self.signatures.setdefault(group, []).append(signature)

    def graphs_of(self, group: str) -> int:
        return len(self.signatures.get(group, ()))

    @property
    def graphs(self) -> int:
        return sum(len(s) for s in self.signatures.values())

    @property
    def recompiles(self) -> int:
        return sum(len(s) - len(set(s)) for s in self.signatures.values())

    def __repr__(self) -> str:
        groups = ", ".join(f"{name}={len(s)}" for name, s in self.signatures.items())
        return f"CompileStats(graphs={self.graphs} ({groups}), recompiles={self.recompiles})"


def counting_backend(backend: str | Callable, stats: CompileStats, group: str = "unit") -> Callable:
    """``backend`` (a registered name such as "inductor" or "aot_eager", or a callable) that first records each
    graph it is handed in ``stats`` under ``group`` and logs it."""
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        signature = (torch.is_grad_enabled(), tuple((tuple(x.shape), str(x.dtype)) for x in tensors))
        stats.record(group, signature)
        level = logging.WARNING if stats.recompiles else logging.INFO
        log.log(level, "%s: compiled graph %d (%d recompiles) for %d tensor inputs, grad %s", group,
                stats.graphs_of(group), stats.recompiles, len(signature[1]), "on" if signature[0] else "off")
        return inner(graph, example_inputs)

    return compile_graph


def template(module: nn.Module, prefix: str) -> nn.Module:
    """A copy of the unit at ``prefix`` (e.g. "blocks.0.") to serve as every unit's template. Take it before routing;
    with a skeleton's meta params the copy costs no memory."""
    unit = _unit(module, prefix)
    if "forward" in vars(unit):
        raise ValueError(f"template: unit {prefix!r} is already routed; take the template before install_units")
    return copy.deepcopy(unit)


def unit_function(unit_template: nn.Module) -> UnitFn:
    """``fn(params, buffers, *args, **kwargs)``: the template applied with ``params`` and ``buffers``
    (``fvx.core.functional.call``). A new code object per call, so each installed model keeps its own torch.compile
    cache (dynamo caches per code object and stops compiling past ``torch._dynamo.config.recompile_limit`` entries)."""

    def run_unit(params, buffers, *args, **kwargs):
        return functional.call(unit_template, params, buffers, args, kwargs)

    return types.FunctionType(run_unit.__code__.replace(), run_unit.__globals__, run_unit.__name__, None,
                              run_unit.__closure__)


def whole_function(module: nn.Module, stats: CompileStats, backend: str | Callable = "inductor") -> UnitFn:
    """``fn(params, buffers, kwargs)``: ``module(**kwargs)`` with ``params`` and ``buffers``, the whole forward as one
    ``torch.compile(fullgraph=True, dynamic=False)``'d graph per input signature, counted in ``stats`` under
    "model" (``mode="model"``). For one process: on a mesh whole-model compile with remat gave wrong patch-embedding
    gradients under inductor (design §3)."""

    def run_model(params, buffers, kwargs):
        return functional_call(module, (params, buffers), (), kwargs, strict=True)

    fresh = types.FunctionType(run_model.__code__.replace(), run_model.__globals__, run_model.__name__, None,
                               run_model.__closure__)
    return torch.compile(fresh, backend=counting_backend(backend, stats, group="model"), fullgraph=True,
                         dynamic=False)


def _unit(module: nn.Module, prefix: str) -> nn.Module:
    if not (isinstance(prefix, str) and prefix.endswith(".") and len(prefix) > 1):
        raise ValueError(f"unit prefix {prefix!r} must name a submodule and end with '.' (e.g. 'blocks.0.')")
    try:
        return module.get_submodule(prefix[:-1])
    except AttributeError:
        raise ValueError(f"unit prefix {prefix!r} names no submodule of {type(module).__name__}") from None


def structure(unit: nn.Module) -> tuple:
    """What units of one group share: their class and their params' and buffers' names, shapes and dtypes."""
    return (type(unit), tuple((n, tuple(p.shape), p.dtype) for n, p in unit.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in unit.named_buffers()))


Gather = Callable[[str, Mapping[str, torch.Tensor], Callable[[Mapping[str, torch.Tensor]], Any]], Any]


def _routed_forward(unit: nn.Module, prefix: str, fn: UnitFn, gather: Gather | None, contiguous: bool, *args: Any,
                    **kwargs: Any) -> Any:
    params, buffers = functional.held(unit)
    if contiguous:
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: a.contiguous() if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
    if gather is None:
        return fn(params, buffers, *args, **kwargs)
    return gather(prefix, params, lambda full: fn(full, buffers, *args, **kwargs))


def route_units(module: nn.Module, units: Sequence[str], fn: UnitFn, *, gather: Gather | None = None,
                contiguous: bool = False) -> None:
    """Make every unit's ``forward`` call ``fn(its params, its buffers, *args, **kwargs)``, through
    ``gather(prefix, params, compute)`` when given (mutates ``module``; the units are recorded for
    :func:`routed_units`). With ``contiguous`` tensor arguments, positional or keyword, are made contiguous first, so
    that a compiled ``fn`` sees the same strides from every unit (HunyuanVideo's single-stream blocks hand the next one
    a slice of their output; CogVideoX's first block gets a slice of the joint text and video tokens)."""
    for prefix in units:
        unit = _unit(module, prefix)
        unit.forward = functools.partial(_routed_forward, unit, prefix, fn, gather, contiguous)
    object.__setattr__(module, _ROUTED, routed_units(module) + tuple(units))


def routed_units(module: nn.Module) -> tuple[str, ...]:
    """The unit prefixes :func:`install_units` routed in ``module``, of every group (empty if none)."""
    return vars(module).get(_ROUTED, ())


def check_group(module: nn.Module, name: str, units: Sequence[str]) -> None:
    """A ValueError unless ``units`` name existing submodules of one structure (class, param and buffer shapes)."""
    if not units:
        raise ValueError(f"unit group {name!r} has no units")
    first = structure(_unit(module, units[0]))
    for prefix in units[1:]:
        if structure(_unit(module, prefix)) != first:
            raise ValueError(f"unit {prefix!r} differs from unit {units[0]!r} of group {name!r} (class, param or "
                             "buffer shapes)")


def install_units(
    module: nn.Module,
    groups: Mapping[str, Sequence[str]],
    *,
    mode: Mode = "none",
    gather: Gather | None = None,
    backend: str | Callable = "inductor",
    templates: Mapping[str, nn.Module] | None = None,
) -> CompileStats:
    """Route each group's units of ``module`` through one function over a template unit of the group: eager
    (``mode="none"``) or one ``torch.compile``'d function per group (``mode="blocks"``, with ``backend``).
    ``gather`` runs each unit on gathered params (sharding, compute-dtype casts; module docstring). ``templates[group]``
    may be shared between models of one architecture; by default it is a copy of the group's first unit. Returns
    the compile counters (empty for "none"). A ValueError names a bad mode, a unit that does not exist, or one unlike
    its group's first."""
    if mode not in ("none", "blocks"):
        raise ValueError(f"install_units compiles units: mode must be 'none' or 'blocks', got {mode!r} (a whole "
                         "model compiles through whole_function)")
    if not groups:
        raise ValueError("install_units needs at least one unit group")
    if routed_units(module):
        raise ValueError(f"install_units: {type(module).__name__} already has routed units")
    templates = dict(templates or {})
    unknown = sorted(set(templates) - set(groups))
    if unknown:
        raise ValueError(f"install_units: templates for unknown unit groups {unknown}")
    stats = CompileStats()
    fns = {}
    for name, units in groups.items():
        units = tuple(units)
        check_group(module, name, units)
        unit_template = templates.get(name) or template(module, units[0])
        if structure(unit_template)[:2] != structure(_unit(module, units[0]))[:2]:
            raise ValueError(f"install_units: the template of group {name!r} is not of its units' class and shapes")
        fn = unit_function(unit_template)
        if mode == "blocks":
            fn = torch.compile(fn, backend=counting_backend(backend, stats, group=name), fullgraph=True,
                               dynamic=False)
        fns[name] = (units, fn)
    for units, fn in fns.values():
        route_units(module, units, fn, gather=gather, contiguous=mode == "blocks")
    return stats
