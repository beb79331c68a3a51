"""Functional FSDP2-style sharding of a params pytree (SimpleFSDP, design §3): the layout of shards at rest.

At rest a params dict is a :class:`Shards`: this rank's local slices as plain tensors, with the layout that places them
on a (replicate, shard) device mesh (``fvx.distributed.processes.make_mesh``) as ``(Replicate(), Shard(d))``: each rank
of a shard group holds one even slice, and replica groups (HSDP) hold the same slices. Even means identical local shapes
on every rank, so every rank compiles the same graphs: ``d`` is the first dimension the shard size divides, and a param
none of whose dimensions it divides is zero-padded on dim 0 up to the next multiple (:class:`ShardSpec` records the
padding; :func:`unshard` and :func:`checkpoint_view` strip it). The layout travels in the pytree node itself, so grads,
AdamW moments and EMA mapped from a ``Shards`` carry it; DTensors appear only where the global view is needed (a
checkpoint's full shapes). In use, each unit gathers its params just before it runs (``fvx.distributed.gathers``).
Optimizer, EMA and gradient norm run on the local shards as they are; the zero padding stays zero under AdamW and EMA.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fvx.core.tree import map_tensors, register_node, tensor_leaves, tree_map
from fvx.distributed.processes import group_of, mesh_device, SHARD

Params = dict[str, torch.Tensor]
DtypeSpec = torch.dtype | Mapping[str, torch.dtype | None] | None  # one dtype, one per param name, or keep


class ShardSpec(NamedTuple):
    """How one param is sharded: its full ``shape``, the sharded ``dim``, and that dim's size after zero padding
    (``padded``, a multiple of the shard size; equal to ``shape[dim]`` unless no dimension divides)."""

    shape: tuple[int, ...]
    dim: int
    padded: int

    def padded_shape(self) -> tuple[int, ...]:
        return self.shape[: self.dim] + (self.padded,) + self.shape[self.dim + 1:]

    def local_shape(self, shard_size: int) -> tuple[int, ...]:
        return self.shape[: self.dim] + (self.padded // shard_size,) + self.shape[self.dim + 1:]


Layout = dict[str, ShardSpec]


def shard_spec(shape: Sequence[int], shard_size: int) -> ShardSpec:
    """Shard the first dimension ``shard_size`` divides; if none does, pad dim 0 to a multiple of it."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("a 0-dim param cannot be sharded; store it with shape [1]")
    for dim, size in enumerate(shape):
        if size % shard_size == 0:
            return ShardSpec(shape, dim, size)
    return ShardSpec(shape, 0, math.ceil(shape[0] / shard_size) * shard_size)


def plan(shapes: Mapping[str, Sequence[int]], shard_size: int) -> Layout:
    """The :class:`ShardSpec` of every param, from full shapes alone (a pure function: every rank agrees)."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive int, got {shard_size!r}")
    layout = {}
    for name, shape in shapes.items():
        try:
            layout[name] = shard_spec(shape, shard_size)
        except ValueError as error:
            raise ValueError(f"param {name!r}: {error}") from None
    return layout


def dtype_for(spec: DtypeSpec, name: str) -> torch.dtype | None:
    """The compute dtype ``spec`` gives param ``name`` (None: keep its own)."""
    if spec is None or isinstance(spec, torch.dtype):
        return spec
    return spec.get(name)


def _placements(spec: ShardSpec) -> tuple:
    return (Replicate(), Shard(spec.dim))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def local_rows(spec: ShardSpec, index: int, shard_size: int) -> tuple[int, int]:
    """``(start, count)`` of the real (unpadded) rows along ``spec.dim`` that shard ``index`` of ``shard_size``
    holds; the rest of its even shard is padding."""
    chunk = spec.padded // shard_size
    start = min(index * chunk, spec.shape[spec.dim])
    return start, max(0, min(chunk, spec.shape[spec.dim] - start))


def local_slice(full: torch.Tensor, spec: ShardSpec, index: int, shard_size: int) -> torch.Tensor:
    """Shard ``index`` of ``shard_size`` of the zero-padded ``full`` tensor, of the even local shape: a view of
    ``full`` where no padding falls in it, else a new tensor ending in zeros."""
    chunk = spec.padded // shard_size
    start, real = local_rows(spec, index, shard_size)
    part = full.narrow(spec.dim, start, real)
    if real == chunk:
        return part
    pad_shape = list(part.shape)
    pad_shape[spec.dim] = chunk - real
    return torch.cat([part, part.new_zeros(pad_shape)], dim=spec.dim)


class Shards(dict):
    """This rank's local shards of a params-like dict (params, grads, AdamW moments, an EMA) with their
    :data:`Layout`. The layout is static metadata of the pytree node (like a JAX treedef's static fields), so every tree
    mapped from a ``Shards`` (gradients from ``fvx.core.grad``, AdamW's moments, an EMA) is a ``Shards`` with the same
    layout: a state describes its own layout, whatever the names of its params (a critic of another size, adapters).
    Values are local tensors (or ``None`` holes); a plain comprehension over it gives a plain dict."""

    def __init__(self, local: Mapping[str, torch.Tensor | None], layout: Mapping[str, ShardSpec]):
        super().__init__(local)
        unknown = [name for name in self if name not in layout]
        if unknown:
            raise ValueError(f"Shards: no layout for {sorted(unknown)[:10]}")
        self.layout: Layout = {name: layout[name] for name in self}

    def select(self, names: Iterable[str]) -> Shards:
        """The shards of ``names`` only, with their layout."""
        return Shards({name: self[name] for name in names}, self.layout)

    def __repr__(self) -> str:
        return f"Shards({dict.__repr__(self)})"


def _flatten_shards(node: Shards):
    """Leaves in sorted key order, as optree flattens a dict; the insertion order is kept for unflattening."""
    names = sorted(node)
    return [node[n] for n in names], (tuple(names), tuple(node), tuple((n, node.layout[n]) for n in node)), names


def _unflatten_shards(meta, values) -> Shards:
    names, order, layout = meta
    by_name = dict(zip(names, values))
    return Shards({n: by_name[n] for n in order}, dict(layout))


register_node(Shards, _flatten_shards, _unflatten_shards)


def per_sample(rows: Mapping[str, torch.Tensor], shard_size: int) -> Shards:
    """A rank's rows of per-sample tensors (dim 0: its samples, an even share of the batch of ``shard_size`` ranks)
    as :class:`Shards` along dim 0, so that a checkpoint saves every rank's rows and restores them onto any number of
    ranks (each reading the rows of the samples it then holds)."""
    layout = {name: ShardSpec((t.shape[0] * shard_size, *t.shape[1:]), 0, t.shape[0] * shard_size)
              for name, t in rows.items()}
    return Shards(dict(rows), layout)


def shard(params: Mapping[str, torch.Tensor], mesh: DeviceMesh, *, layout: Layout | None = None,
          dtype: DtypeSpec = None) -> Shards:
    """``params`` (full tensors, the same on every rank) as this rank's even shards on ``mesh``'s device, in
    ``dtype`` (one dtype, or per name; None keeps each param's own: a frozen teacher is sharded in bf16). Params are
    read one at a time and only the local slice is kept, so a lazy mapping (one that loads on access) never holds
    more than one full param. ``layout`` defaults to :func:`plan` of the shapes."""
    group = group_of(mesh)
    layout = plan({name: tuple(p.shape) for name, p in params.items()}, group.shard_size) if layout is None else layout
    missing = [name for name in params if name not in layout]
    if missing:
        raise ValueError(f"shard: the layout has no entry for {sorted(missing)[:10]}")
    index, device = mesh.get_local_rank(SHARD), mesh_device(mesh)
    out = {}
    for name, full in params.items():
        spec = layout[name]
        if tuple(full.shape) != spec.shape:
            raise ValueError(f"shard: param {name!r} has shape {tuple(full.shape)}, its layout says {spec.shape}")
        part = local_slice(full.detach(), spec, index, group.shard_size)
        out[name] = torch.empty(part.shape, dtype=dtype_for(dtype, name) or full.dtype, device=device).copy_(part)
    return Shards(out, layout)


def _strip(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    if spec.padded == spec.shape[spec.dim]:
        return full
    return full.narrow(spec.dim, 0, spec.shape[spec.dim]).clone()


def unshard(shards: Shards, mesh: DeviceMesh) -> Params:
    """Full, unpadded tensors on every rank (a collective: every rank calls it with the same names in the same
    order). For export and tests; training never needs it."""
    dtensors = _dtensors(shards, mesh)
    return {name: _strip(dt.full_tensor(), shards.layout[name]) for name, dt in dtensors.items()}


def _dtensors(shards: Shards, mesh: DeviceMesh) -> dict[str, DTensor | None]:
    """The shards as DTensors of the padded shapes on ``mesh`` (sharing storage; ``None`` holes stay ``None``)."""
    group = group_of(mesh)
    out = {}
    for name, local in shards.items():
        spec = shards.layout[name]
        if local is None:
            out[name] = None
            continue
        if tuple(local.shape) != spec.local_shape(group.shard_size):
            raise ValueError(f"{name!r} has shape {tuple(local.shape)}, expected the local shape "
                             f"{spec.local_shape(group.shard_size)}")
        out[name] = DTensor.from_local(local.detach(), mesh, _placements(spec), run_check=False,
                                       shape=spec.padded_shape(), stride=_contiguous_stride(spec.padded_shape()))
    return out


def checkpoint_view(shards: Shards, mesh: DeviceMesh) -> dict[str, DTensor | None]:
    """DTensors of the *unpadded* full shapes whose local tensors are views of the padded shards (no copy): the global
    view of sharded state (its full shapes, as a checkpoint records them; ``torch.distributed.checkpoint`` also loads
    into it). Padded params become torch.chunk-style uneven shards (the last ranks hold fewer rows, maybe none)."""
    out = {}
    for name, dt in _dtensors(shards, mesh).items():
        spec = shards.layout[name]
        if dt is None or spec.padded == spec.shape[spec.dim]:
            out[name] = dt
            continue
        chunk = spec.padded // mesh.size(1)
        real = max(0, min(chunk, spec.shape[0] - mesh.get_local_rank(SHARD) * chunk))
        out[name] = DTensor.from_local(dt.to_local().narrow(0, 0, real), mesh, _placements(spec), run_check=False,
                                       shape=spec.shape, stride=_contiguous_stride(spec.shape))
    return out


def _is_shards(node: Any) -> bool:
    return isinstance(node, Shards)


def checkpoint_tree(state: Any, mesh: DeviceMesh) -> Any:
    """``state`` with every :class:`Shards` node as its :func:`checkpoint_view` (a plain dict of DTensors of the full
    shapes): what a checkpoint's shapes are checked against. Other leaves (a step, a key, counts, replicated
    tensors) stay plain."""
    return tree_map(lambda node: checkpoint_view(node, mesh) if _is_shards(node) else node, state,
                    is_leaf=_is_shards, none_is_leaf=True)


def to_local(tree: Any) -> Any:
    """Every ``DTensor`` leaf of ``tree`` as its local shard: the same storage (in-place updates of the result
    update the DTensor), detached. Other leaves pass through."""
    return map_tensors(lambda x: x.to_local().detach() if isinstance(x, DTensor) else x, tree)


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds for the tensor leaves of ``tree`` (local shards of DTensors)."""
    return sum(x.numel() * x.element_size() for x in tensor_leaves(to_local(tree)))
