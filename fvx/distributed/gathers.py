"""Gathering sharded params where they are used (SimpleFSDP, design §3): per unit, bucketed, prefetchable.

A unit (the root, or one transformer block) gathers its params just before it runs, through an ``autograd.Function``
over collectives addressed by process-group *name* (plain data, no ``DeviceMesh``): forward one all-gather per compute
dtype (bf16 halves the traffic), backward one ``reduce_scatter_tensor`` in fp32 (then an ``all_reduce`` over the
replicas under HSDP). Gradients come back averaged over the data-parallel ranks, so each rank's loss is the plain mean
over its own (equal-sized) slice of the global batch, exactly as in one process. Under sequence parallelism
(``fvx.distributed.sequence_parallel``) the ranks of an SP group hold the same samples and each contributes its tokens'
part of their gradient: the sums still run over every rank, the divisor is the number of data-parallel groups
(``Group.dp_size``). A gather may be issued ahead of its use (:func:`issue_gather`) and waited on where used; when each
unit gathers, prefetches the next and drops its full params after the forward is ``fvx.distributed.gather_schedule``.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from fvx.core import functional
from fvx.distributed import compile as fvx_compile
from fvx.distributed.processes import Group, wait
from fvx.distributed.sharding import dtype_for, DtypeSpec, Layout, Params, ShardSpec


def gather(local: torch.Tensor, spec: ShardSpec, group: Group, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full (unpadded) param of ``local``'s shard, in ``compute_dtype``; differentiable (a bucket of one, see
    :func:`gather_params`). In a single process (``Group()``) it is only the cast."""
    if group.ranks == 1:
        return local if compute_dtype is None else local.to(compute_dtype)
    return gather_params({"param": local}, {"param": spec}, group, compute_dtype)["param"]


class _Bucket(NamedTuple):
    """The static plan of one bucketed gather: each param's spec and local dtype, the compute dtype, the group."""

    specs: tuple[ShardSpec, ...]
    local_dtypes: tuple[torch.dtype, ...]
    dtype: torch.dtype
    group: tuple  # (shard name, shard size, replicate name, replicate size, data-parallel size)


class _InFlight(NamedTuple):
    """An all-gather issued and not yet waited on: its output buffer and the collective's work handle."""

    buffer: torch.Tensor
    work: dist.Work


def _issue(bucket: _Bucket, xs: Sequence[torch.Tensor]) -> _InFlight:
    """The all-gather of the flat buffer of ``xs`` (each in the compute dtype, sharded dim first) into a
    ``[shard size * local numel]`` buffer, issued and not waited on (:func:`_landed`). Through ``all_gather_single``,
    not the functional ``all_gather_into_tensor``, whose gloo path corrupts the heap with several in flight (design
    §3)."""
    shard_name, shard_size, *_ = bucket.group
    flat = torch.cat([_rows_first(x.to(bucket.dtype), spec).reshape(-1) for x, spec in zip(xs, bucket.specs)])
    buffer = flat.new_empty(shard_size * flat.numel())
    group = dist.distributed_c10d._resolve_process_group(shard_name)
    return _InFlight(buffer, dist.all_gather_single(buffer, flat, group=group, async_op=True))


def _landed(gather: _InFlight) -> torch.Tensor:
    """The output buffer of an issued all-gather, once it has arrived."""
    gather.work.wait()
    return gather.buffer


def _cut(bucket: _Bucket, gathered: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The full (unpadded) params of a waited all-gathered flat buffer, each its own contiguous tensor."""
    shard_size = bucket.group[1]
    full = gathered.view(shard_size, -1)
    out, offset = [], 0
    for spec in bucket.specs:
        local = spec.local_shape(shard_size)
        moved = (local[spec.dim], *local[:spec.dim], *local[spec.dim + 1:])
        n = math.prod(local)
        part = full[:, offset:offset + n].reshape(shard_size * moved[0], *moved[1:])
        part = part.movedim(0, spec.dim) if spec.dim else part
        out.append(part if part.shape[spec.dim] == spec.shape[spec.dim] else
                   part.narrow(spec.dim, 0, spec.shape[spec.dim]))
        offset += n
    return tuple(out)


class _GatherBucket(torch.autograd.Function):
    """Forward: one all-gather of a flat buffer of the bucket's local shards (cast to the compute dtype), cut back
    into the full params; ``issued`` is that all-gather issued earlier (a prefetch) or None to issue it now.
    Backward: one fp32 reduce-scatter (+ replica all-reduce) of the flat buffer of their gradients, averaged over
    data-parallel ranks: the same sums, element by element, as one collective per param; the gradients come back as
    views of the reduce-scatter's ``AsyncCollectiveTensor``, which waits when first read (``fvx.core.grad`` settles
    them), so the reduction overlaps the rest of the backward. The sums run over every
    rank; the ranks of a sequence-parallel group contribute their tokens' parts of one sample's gradient, so the
    divisor is the data-parallel size, not the number of ranks."""

    @staticmethod
    def forward(ctx, bucket: _Bucket, issued: _InFlight | None, *xs):
        ctx.bucket, ctx.device = bucket, xs[0].device
        if bucket.group[1] == 1:  # replicas only: every rank holds the whole params already
            return tuple(x.to(bucket.dtype) for x in xs)
        return _cut(bucket, _landed(_issue(bucket, xs) if issued is None else issued))

    @staticmethod
    def backward(ctx, *grads):
        bucket = ctx.bucket
        shard_name, shard_size, replicate_name, replicate_size, dp_size = bucket.group
        rows = []
        for g, spec in zip(grads, bucket.specs):
            g = torch.zeros(spec.shape, device=ctx.device) if g is None else g.to(torch.float32)
            g = g / dp_size
            if g.shape[spec.dim] < spec.padded:
                pad = list(g.shape)
                pad[spec.dim] = spec.padded - g.shape[spec.dim]
                g = torch.cat([g, g.new_zeros(pad)], dim=spec.dim)
            rows.append(_rows_first(g, spec).reshape(shard_size, -1))
        flat = torch.cat(rows, dim=1).reshape(-1)
        if shard_size > 1:  # waited on where the gradient is first read: it overlaps the next unit's backward
            flat = AsyncCollectiveTensor(
                torch.ops._c10d_functional.reduce_scatter_tensor(flat, "sum", shard_size, shard_name))
        if replicate_size > 1:
            flat = wait(torch.ops._c10d_functional.all_reduce(flat, "sum", replicate_name))
        out, offset = [], 0
        for spec, dtype in zip(bucket.specs, bucket.local_dtypes):
            local = spec.local_shape(shard_size)
            moved_shape = (local[spec.dim], *local[:spec.dim], *local[spec.dim + 1:])
            n = math.prod(local)
            part = flat[offset:offset + n].reshape(moved_shape)
            out.append((part.movedim(0, spec.dim) if spec.dim else part).contiguous().to(dtype))
            offset += n
        return (None, None, *out)


def _rows_first(x: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``x`` with its sharded dim first, contiguous (the layout collectives concatenate along)."""
    return x.movedim(spec.dim, 0).contiguous() if spec.dim else x.contiguous()


class Issued(NamedTuple):
    """Gathers issued ahead of use (:func:`issue_gather`): per compute dtype the bucket plan, its param names and
    its all-gather in flight (None where the shard group is one rank)."""

    buckets: tuple[tuple[_Bucket, tuple[str, ...], _InFlight | None], ...]


def _buckets(local: Mapping[str, torch.Tensor], layout: Layout, group: Group,
             compute_dtypes: DtypeSpec) -> list[tuple[_Bucket, tuple[str, ...]]]:
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in local.items():
        by_dtype.setdefault(dtype_for(compute_dtypes, name) or t.dtype, []).append(name)
    dims = (group.shard_name, group.shard_size, group.replicate_name, group.replicate_size, group.dp_size)
    return [(_Bucket(tuple(layout[n] for n in names), tuple(local[n].dtype for n in names), dtype, dims), tuple(names))
            for dtype, names in by_dtype.items()]


def issue_gather(local: Mapping[str, torch.Tensor], layout: Layout, group: Group,
                 compute_dtypes: DtypeSpec = None) -> Issued:
    """The bucketed all-gathers of ``local`` issued now and waited on where used (:func:`gather_params` with
    ``issued=``, or :func:`regather`), so their traffic overlaps whatever runs in between. Not differentiable: it
    reads the shards' values; the gradient path is the :func:`gather_params` call that takes them."""
    with torch.no_grad():
        return Issued(tuple((plan, names, _issue(plan, [local[n] for n in names]) if plan.group[1] > 1 else None)
                            for plan, names in _buckets(local, layout, group, compute_dtypes)))


def regather(issued: Issued) -> Params:
    """The full params of gathers issued by :func:`issue_gather`, outside autograd (what a backward that dropped
    them after the forward reads)."""
    out: Params = {}
    with torch.no_grad():
        for plan, names, gather in issued.buckets:
            out.update(zip(names, _cut(plan, _landed(gather))))
    return out


def gather_params(local: Mapping[str, torch.Tensor], layout: Layout, group: Group,
                  compute_dtypes: DtypeSpec = None, issued: Issued | None = None) -> Params:
    """:func:`gather` of every param of ``local`` (names as in ``layout`` and ``compute_dtypes``), bucketed: one
    all-gather forward and one reduce-scatter backward per compute dtype, not one per param. ``issued``: the same
    gathers issued ahead by :func:`issue_gather` on these shards (waited on here instead of issued)."""
    if group.ranks == 1:
        return {name: gather(t, layout[name], group, dtype_for(compute_dtypes, name)) for name, t in local.items()}
    buckets = (issued.buckets if issued is not None else
               tuple((plan, names, None) for plan, names in _buckets(local, layout, group, compute_dtypes)))
    out: Params = {}
    for plan, names, gather in buckets:
        out.update(zip(names, _GatherBucket.apply(plan, gather, *(local[n] for n in names))))
    return {name: out[name] for name in local}


def _unit_of(name: str, units: Sequence[str]) -> str | None:
    return next((prefix for prefix in units if name.startswith(prefix)), None)


def gather_root(local: Mapping[str, torch.Tensor], layout: Layout, units: Sequence[str], group: Group,
                compute_dtypes: DtypeSpec = None) -> Params:
    """The params to bind for a call of the whole module: the root's own params (those under no unit prefix)
    gathered, the units' params passed through as local shards (each unit gathers its own when it runs)."""
    root = gather_params({name: t for name, t in local.items() if not _unit_of(name, units)}, layout, group,
                         compute_dtypes)
    return {name: root.get(name, t) for name, t in local.items()}


def sharded_call(module: torch.nn.Module, local: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 args: tuple = (), kwargs: Mapping[str, Any] | None = None, *, gathers: Any) -> Any:
    """``module(*args, **kwargs)`` with sharded params: a functional call with the root's params gathered and each
    unit's local shards, which the unit gathers itself when it runs, in one prefetch window of ``gathers`` (a
    ``fvx.distributed.gather_schedule.UnitGathers`` whose units have been routed:
    ``fvx.distributed.compile.install_units(..., gather=)``)."""
    units = fvx_compile.routed_units(module)
    if not units:
        raise ValueError("sharded_call: no units are routed in this module; call "
                         "fvx.distributed.compile.install_units with "
                         "gather=fvx.distributed.gather_schedule.UnitGathers(...) first")
    with gathers.window(local):
        bound = gather_root(local, gathers.layout, units, gathers.group, gathers.compute_dtypes)
        return functional.call(module, bound, buffers, args, kwargs)


def names_by_unit(names: Iterable[str], units: Sequence[str]) -> dict[str | None, list[str]]:
    """Param names grouped by their unit prefix (None: the root)."""
    out: dict[str | None, list[str]] = {None: [], **{prefix: [] for prefix in units}}
    for name in names:
        out[_unit_of(name, units)].append(name)
    return out
