"""When a sharded model's units gather their params: the schedule around each unit's compute (design §3).

Forward (prefetch): within one call of the model (:meth:`UnitGathers.window`), a unit waits on the gather the unit
before it issued, then issues the next unit's before computing, so that gather's traffic runs under this unit's
compute; the window opens by issuing the first unit's beside the root's gather.

Backward (reshard after forward): the full params a unit's ops save for the backward are not kept. A saved-tensors
hook swaps each for a note of which param it views; the unit's backward gathers the unit again on first use (issuing
the previous unit's regather ahead, to overlap this unit's backward) and drops the full params once it has read every
note. Without it the full params of every unit live from the forward to the backward. Under remat a unit recomputes
from its shards, so its gather runs again in the backward anyway and no hooks are installed; instead each recompute
issues the gather of the unit recomputed after it (the one before it in the forward).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from fvx.distributed import gathers, processes, sharding

Params = dict[str, torch.Tensor]


def _relative(layout: sharding.Layout, compute_dtypes: sharding.DtypeSpec, prefix: str) -> tuple[dict, dict]:
    names = [name for name in layout if name.startswith(prefix)]
    if not names:
        raise ValueError(f"unit {prefix!r} has no params in the layout")
    return ({name[len(prefix):]: layout[name] for name in names},
            {name[len(prefix):]: sharding.dtype_for(compute_dtypes, name) for name in names})


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage (a subclass, a sparse tensor)
        return None


def _same(a: Params, b: Params) -> bool:
    """Whether two unit param dicts hold the very same tensors."""
    return len(a) == len(b) and all(b.get(name) is t for name, t in a.items())


class _Note(NamedTuple):
    """A saved tensor that views a gathered param: the param's name and the view's geometry."""

    name: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Resharded:
    """One unit's gathered params as its backward sees them: dropped after the forward, gathered again on first
    use, dropped again when every saved view of them has been read."""

    def __init__(self, local: Params, layout: dict, group: processes.Group, dtypes: dict, full: Params,
                 previous: _Resharded | None, counts: dict[str, int]):
        self._args, self._counts = (local, layout, group, dtypes), counts
        self._names = {_storage(t): name for name, t in full.items()}
        self._previous, self._full, self._issued, self._open = previous, None, None, 0

    def pack(self, t: torch.Tensor) -> Any:
        name = self._names.get(_storage(t)) if self._names else None
        if name is None:
            return t
        self._open += 1
        return _Note(name, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def seal(self) -> None:
        """The forward is over: forget its params (a later tensor at the same address is not theirs)."""
        self._names = None

    def prefetch(self) -> None:
        if self._open and self._full is None and self._issued is None:
            self._issued = gathers.issue_gather(*self._args)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Note):
            return saved
        if self._full is None:
            self._counts["ahead" if self._issued else "on_demand"] += 1
            self._full = gathers.regather(self._issued or gathers.issue_gather(*self._args))
            self._issued = None
            if self._previous is not None:
                self._previous.prefetch()
        view = self._full[saved.name].as_strided(saved.size, saved.stride, saved.offset)
        self._open -= 1
        if not self._open:
            self._full = None
        return view


class UnitGathers:
    """The gathers of one sharded model's units (``groups``: unit group -> unit prefixes, in the order the forward
    runs them), called by each routed unit as ``gathers(prefix, local_params, compute)``: it gathers the unit's
    params (names relative to the unit) and returns ``compute(full_params)``. ``prefetch`` issues the next unit's
    gather before a unit computes (with ``remat``, also the previous unit's before a unit recomputes in the
    backward); ``reshard_after_forward`` drops the full params after the forward (module docstring; it needs a shard
    group of more than one rank and is implied by remat). A prefetched gather is used only by a unit called on the
    very shards it was issued from, so a wrong guess costs time, never values. A ValueError names a unit whose layout
    or dtypes differ from its group's first."""

    def __init__(self, groups: Mapping[str, Sequence[str]], layout: sharding.Layout, group: processes.Group,
                 compute_dtypes: sharding.DtypeSpec = None, *, prefetch: bool = True,
                 reshard_after_forward: bool = True, remat: bool = False):
        self.layout, self.group, self.compute_dtypes = layout, group, compute_dtypes
        self.prefetch = prefetch and group.shard_size > 1  # (replicas only: nothing to gather)
        self.reshard_after_forward = reshard_after_forward and not remat and group.shard_size > 1
        self.remat = remat
        self._units: dict[str, tuple[dict, dict]] = {}
        for units in groups.values():
            if not units:
                raise ValueError("UnitGathers needs at least one unit prefix per group")
            first = _relative(layout, compute_dtypes, units[0])
            for prefix in units:
                if _relative(layout, compute_dtypes, prefix) != first:
                    raise ValueError(f"unit {prefix!r} is laid out unlike unit {units[0]!r}: units must share one "
                                     "structure")
                self._units[prefix] = first
        order = list(self._units)
        self._next = dict(zip(order, order[1:]))
        self._first = order[0] if order else None
        self._local: Mapping[str, torch.Tensor] | None = None  # the model's shards during a window
        self._issued: dict[str, tuple[Params, gathers.Issued]] = {}  # prefix -> (the shards, their gathers)
        self._previous: _Resharded | None = None  # the last unit resharded in this window
        self._ran: list[tuple[str, Params]] = []  # the units of the last window, for their recompute (remat)
        self.counts = {"ahead": 0, "on_demand": 0}  # unit gathers (and regathers) issued ahead of use or not

    @contextlib.contextmanager
    def window(self, local: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """One call of the model on shards ``local`` (full names): prefetching runs inside it; what it issued and
        no unit took is waited on at the end."""
        if self._local is not None:
            raise RuntimeError("UnitGathers.window: the model is already being called (windows do not nest)")
        self._drain()  # (a backward that recomputed only part of the model leaves its last prefetch)
        self._local, self._previous, self._ran = local, None, []
        try:
            if self.prefetch:
                self._issue(self._first, self._shards_of(self._first))
            yield
            self._drain()
        except BaseException:
            self._issued = {}  # not waited on: the other ranks may never issue their halves
            raise
        finally:
            self._local, self._previous = None, None

    def _drain(self) -> None:
        for _, issued in self._issued.values():
            gathers.regather(issued)
        self._issued = {}

    def _shards_of(self, prefix: str | None) -> Params | None:
        if prefix is None:
            return None
        return {name[len(prefix):]: t for name, t in self._local.items() if name.startswith(prefix)}

    def _issue(self, prefix: str | None, local: Params | None) -> None:
        if prefix is not None and prefix not in self._issued:
            layout, dtypes = self._units[prefix]
            self._issued[prefix] = (local, gathers.issue_gather(local, layout, self.group, dtypes))

    def _take(self, prefix: str, local: Params) -> gathers.Issued | None:
        """The gather issued ahead for ``prefix`` if it was issued from these very shards (else it is waited on and
        dropped)."""
        shards, issued = self._issued.pop(prefix, (None, None))
        if issued is not None and not _same(shards, local):
            gathers.regather(issued)
            issued = None
        self.counts["ahead" if issued else "on_demand"] += 1
        return issued

    def _prefetch(self, prefix: str, local: Params) -> None:
        """Issue the gather the next unit will want: in a window the next unit's; in a recompute (outside any
        window, under grad) the unit before this one in the last window's order."""
        if self._local is not None:
            self._issue(self._next.get(prefix), self._shards_of(self._next.get(prefix)))
            if self.remat and torch.is_grad_enabled():
                self._ran.append((prefix, local))
        elif self.remat and torch.is_grad_enabled():
            at = next((i for i, (ran, shards) in enumerate(self._ran) if ran == prefix and _same(shards, local)), None)
            if at is not None:
                if at:
                    self._issue(*self._ran[at - 1])
                del self._ran[at:]

    def __call__(self, prefix: str, local: Params, compute: Callable[[Params], Any]) -> Any:
        layout, dtypes = self._units[prefix]
        full = gathers.gather_params(local, layout, self.group, dtypes, issued=self._take(prefix, local))
        if self.prefetch:
            self._prefetch(prefix, local)
        if not (self.reshard_after_forward and torch.is_grad_enabled()):
            return compute(full)
        held = _Resharded(local, layout, self.group, dtypes, full, self._previous, self.counts)
        if self._local is not None:
            self._previous = held
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            out = compute(full)
        held.seal()
        return out
