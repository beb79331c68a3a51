"""Functional FSDP2-style sharding of a params pytree (SimpleFSDP, design §3): shards at rest, per-unit gathers in use.

At rest a params dict is a :class:`Shards`: this rank's local slices as plain tensors, with the layout that places them
on a (replicate, shard) device mesh as ``(Replicate(), Shard(d))``: each rank of a shard group holds one even slice,
and replica groups (HSDP) hold the same slices. Even means identical local shapes on every rank, so every rank
compiles the same graphs: ``d`` is the first dimension the shard size divides, and a param none of whose dimensions
it divides is zero-padded on dim 0 up to the next multiple (:class:`ShardSpec` records the padding; :func:`unshard`
and :func:`checkpoint_view` strip it). The layout travels in the pytree node itself, so grads, AdamW moments and EMA
mapped from a ``Shards`` carry it; DTensors appear only where the global view is needed (a checkpoint's full shapes).

In use, a unit (the root, or one transformer block) gathers its params just before it runs, through an
``autograd.Function`` over collectives addressed by process-group *name* (plain data, no ``DeviceMesh``): forward
``all_gather_into_tensor`` in the compute dtype (bf16 halves the traffic), backward ``reduce_scatter_tensor`` in
fp32 (then an ``all_reduce`` over the replicas under HSDP). Gradients come back averaged
over the data-parallel ranks, so each rank's loss is the plain mean over its own (equal-sized) slice of the global
batch, exactly as in one process. Under sequence parallelism (``make_mesh(sp=)``, ``fvx.sequence_parallel``) the
ranks of an SP group hold the same samples and each contributes its tokens' part of their gradient: the sums still
run over every rank, the divisor is the number of data-parallel groups (``Group.dp_size``). A gather may be issued
ahead of its use (:func:`issue_gather`) and waited on where used; when each unit gathers, prefetches the next and
drops its full params after the forward is ``fvx.gather_schedule``.

Optimizer, EMA and gradient norm run on the local shards as they are; the zero padding stays zero under AdamW and
EMA, and the global norm is one ``all_reduce`` of the local sum of squares.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.func import functional_call

from fvx import compile as fvx_compile
from fvx import sequence_parallel as fsp
from fvx.tree import map_tensors, register_node, tensor_leaves, tree_map

Params = dict[str, torch.Tensor]
DtypeSpec = torch.dtype | Mapping[str, torch.dtype | None] | None  # one dtype, one per param name, or keep

REPLICATE, SHARD = "replicate", "shard"  # mesh dimension names


# --------------------------------------------------------------------------------------------------------- processes


class Dist(NamedTuple):
    """This process's place in the run: ``backend`` is None for a single process without torch.distributed."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise ValueError(f"init_distributed: WORLD_SIZE is set but {name} is not (launch with torchrun)") from None
    except ValueError:
        raise ValueError(f"init_distributed: environment variable {name}={env[name]!r} is not an integer") from None


def init_distributed(env: Mapping[str, str] | None = None) -> Dist:
    """Join the process group torchrun describes in ``env`` (default ``os.environ``): NCCL with one GPU per local
    rank where CUDA exists (it becomes the current device), gloo on CPUs. Without ``WORLD_SIZE`` in ``env`` this is
    a single process: nothing is initialised. Calling it again returns the same answer."""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in env:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return Dist(0, 1, 0, device, None)
    world, rank = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
    local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"init_distributed: RANK={rank} does not lie in [0, WORLD_SIZE={world})")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
        if missing:
            raise ValueError(f"init_distributed: {', '.join(missing)} not set (launch with torchrun)")
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://{env['MASTER_ADDR']}:{_env_int(env, 'MASTER_PORT')}",
            rank=rank, world_size=world, device_id=device if cuda else None,
        )
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise ValueError(f"init_distributed: the process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                         f"but the environment says rank {rank} of {world}")
    return Dist(rank, world, local_rank, device, dist.get_backend())


def init_jax_distributed(d: Dist, env: Mapping[str, str] | None = None, *, port_offset: int = 100) -> bool:
    """Start ``jax.distributed`` on CPU beside torch.distributed, so that orbax knows which process is its primary
    (without it every process believes it is and concurrent saves clobber each other, design §2 "Checkpoints").
    The coordinator listens on MASTER_ADDR at MASTER_PORT + ``port_offset``. Returns whether it started it: a single
    process, or one where jax.distributed already runs, needs nothing."""
    if d.world == 1:
        return False
    import jax

    if jax.distributed.is_initialized():
        return False
    env = os.environ if env is None else env
    address = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{_env_int(env, 'MASTER_PORT') + port_offset}"
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(coordinator_address=address, num_processes=d.world, process_id=d.rank)
    return True


def make_mesh(replicate: int = 1, shard: int | None = None, *, sp: int = 1,
              device_type: str | None = None) -> DeviceMesh:
    """A ``(replicate, shard)`` device mesh over all processes (HSDP; ``replicate=1`` is plain FSDP). ``shard``
    defaults to world / replicate; ``device_type`` to cuda where available, else cpu. ``sp`` > 1 also makes the
    sequence-parallel groups of ``sp`` consecutive ranks (``fvx.sequence_parallel``; the ranks of one hold the same
    samples) and records them on the mesh, where :func:`group_of` and :func:`sequence_group` read them; the params
    still shard over the whole mesh as without SP."""
    if not dist.is_initialized():
        raise ValueError("make_mesh: torch.distributed is not initialised (call init_distributed under torchrun)")
    world = dist.get_world_size()
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1 or world % replicate:
        raise ValueError(f"make_mesh: replicate={replicate!r} must be a positive divisor of the world size {world}")
    shard = world // replicate if shard is None else shard
    if replicate * shard != world:
        raise ValueError(f"make_mesh: replicate={replicate} x shard={shard} != world size {world}")
    sequence = fsp.make_group(sp)  # checks sp before the mesh's groups exist
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD))
    setattr(mesh, _SEQUENCE, sequence)
    return mesh


_SEQUENCE = "_fvx_sequence_group"  # the mesh attribute holding its fvx.sequence_parallel.SPGroup


def sequence_group(mesh: DeviceMesh | None) -> fsp.SPGroup | None:
    """The sequence-parallel group of ``mesh`` (:func:`make_mesh`'s ``sp``), or None when it has none."""
    group = None if mesh is None else getattr(mesh, _SEQUENCE, None)
    return group if group is not None and group.size > 1 else None


class Group(NamedTuple):
    """What a gather needs to address its collectives: process-group names and sizes (plain data, so compiled graphs
    hold no mesh). ``Group()`` is a single process: gathers only cast. ``sp_size`` > 1: groups of that many ranks
    hold the same samples (sequence parallelism); ``sp_name`` names this rank's."""

    shard_name: str = ""
    shard_size: int = 1
    replicate_name: str = ""
    replicate_size: int = 1
    sp_name: str = ""
    sp_size: int = 1

    @property
    def ranks(self) -> int:
        """Every rank of the mesh: the params shard over ``shard_size`` of them, replica groups hold the same."""
        return self.shard_size * self.replicate_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: groups of ranks that read their own slice of the batch (each rank, without SP)."""
        return self.ranks // self.sp_size


def group_of(mesh: DeviceMesh) -> Group:
    """The :class:`Group` of a mesh made by :func:`make_mesh`."""
    if tuple(mesh.mesh_dim_names or ()) != (REPLICATE, SHARD):
        raise ValueError(f"expected a mesh with dims {(REPLICATE, SHARD)} (make_mesh), got {mesh.mesh_dim_names}")
    sequence = sequence_group(mesh) or fsp.SPGroup()
    return Group(mesh.get_group(SHARD).group_name, mesh.size(1), mesh.get_group(REPLICATE).group_name, mesh.size(0),
                 sequence.name, sequence.size)


def data_rank(mesh: DeviceMesh | None, rank: int, world: int) -> tuple[int, int]:
    """``(rank, world)`` of this process among the data-parallel ranks: the same without SP, ``rank // sp`` of
    ``world // sp`` with it (the ranks of an SP group read the same samples)."""
    sequence = sequence_group(mesh)
    return (rank, world) if sequence is None else (rank // sequence.size, world // sequence.size)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# ------------------------------------------------------------------------------------------------------------ layout


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
    :data:`Layout`. The layout is static metadata of the pytree node (like a JAX treedef's static fields), so every
    tree mapped from a ``Shards`` (gradients from ``fvx.grad``, AdamW's moments, an EMA) is a ``Shards`` with the same
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
    index, device = mesh.get_local_rank(SHARD), _mesh_device(mesh)
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


def local_slices(full: Any, target: Any, mesh: DeviceMesh) -> Any:
    """``full`` (whole tensors, structured like ``target`` but with plain dicts where ``target`` has
    :class:`Shards`) as new tensors shaped like ``target``'s: each ``Shards`` node of ``target`` cut to this rank's
    zero-padded slice of its own layout, other leaves copied; on ``target``'s devices and dtypes."""
    index, size = mesh.get_local_rank(SHARD), mesh.size(1)

    def take(t: Any, f: Any) -> Any:
        if _is_shards(t):
            return Shards({n: None if t[n] is None else
                           torch.empty_like(t[n]).copy_(local_slice(f[n], t.layout[n], index, size)) for n in t},
                          t.layout)
        return map_tensors(lambda a, b: torch.empty_like(a).copy_(b), t, f)

    return tree_map(take, target, full, is_leaf=_is_shards, none_is_leaf=True)


def to_local(tree: Any) -> Any:
    """Every ``DTensor`` leaf of ``tree`` as its local shard: the same storage (in-place updates of the result
    update the DTensor), detached. Other leaves pass through."""
    return map_tensors(lambda x: x.to_local().detach() if isinstance(x, DTensor) else x, tree)


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds for the tensor leaves of ``tree`` (local shards of DTensors)."""
    return sum(x.numel() * x.element_size() for x in tensor_leaves(to_local(tree)))


# ----------------------------------------------------------------------------------------------------------- gathers


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(tensor)


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
    views of the reduce-scatter's ``AsyncCollectiveTensor``, which waits when first read (``fvx.grad`` settles
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
            flat = _wait(torch.ops._c10d_functional.all_reduce(flat, "sum", replicate_name))
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
    """``module(*args, **kwargs)`` with sharded params: ``functional_call`` with the root's params gathered and each
    unit's local shards, which the unit gathers itself when it runs, in one prefetch window of ``gathers`` (a
    ``fvx.gather_schedule.UnitGathers`` whose units have been routed: ``fvx.compile.install_units(..., gather=)``)."""
    units = fvx_compile.routed_units(module)
    if not units:
        raise ValueError("sharded_call: no units are routed in this module; call fvx.compile.install_units with "
                         "gather=fvx.gather_schedule.UnitGathers(...) first")
    with gathers.window(local):
        bound = gather_root(local, gathers.layout, units, gathers.group, gathers.compute_dtypes)
        return functional_call(module, (bound, dict(buffers)), args, dict(kwargs or {}), strict=True)


# ------------------------------------------------------------------------------------------- norms and the optimizer


def global_norm_sharded(tree: Any, group: Group) -> torch.Tensor:
    """sqrt of the sum of squares over all ranks' shards of ``tree`` (DTensors or local shards; every leaf a shard of
    a sharded tensor, replicas identical): one fp32 ``all_reduce`` over the shard group. 0-dim fp32."""
    leaves = [x for x in tensor_leaves(to_local(tree)) if x.is_floating_point()]
    if leaves:
        norms = torch._foreach_norm(leaves, 2.0)
        squares = torch.stack([n.to(torch.float32) for n in norms]).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float32)
    if group.shard_size > 1:
        squares = _wait(torch.ops._c10d_functional.all_reduce(squares, "sum", group.shard_name))
    return squares.sqrt()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any process of the default process group (itself in a single process)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return bool(flag)
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(value, torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def first_error(message: str | None, limit: int = 2048) -> str | None:
    """The error message of the lowest rank that has one (None when no rank has), on every process of the default
    process group: ranks that read different files agree on failing, and each can say why (one all-gather of
    ``limit`` bytes per rank)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return message
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    data = (message or "").encode()[:limit]
    local = torch.zeros(limit + 1, dtype=torch.uint8, device=device)
    local[0] = int(message is not None)
    local[1:1 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, local)
    for row in gathered:
        if int(row[0]):
            return bytes(row[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return None


def dp_max(value: int, group: Group) -> int:
    """The largest of a per-rank integer over the data-parallel ranks (one all-reduce; every rank gets it). The
    ranks of a sequence-parallel group hold the same value, so one data-parallel group needs no collective."""
    if group.dp_size == 1:
        return int(value)
    total = torch.tensor(int(value), dtype=torch.int64)
    for name, size in ((group.shard_name, group.shard_size), (group.replicate_name, group.replicate_size)):
        if size > 1:
            total = _wait(torch.ops._c10d_functional.all_reduce(total, "max", name))
    return int(total)


def dp_mean(value: torch.Tensor, group: Group) -> torch.Tensor:
    """The mean of a per-rank metric (a local loss) over the data-parallel ranks: what one process would log for the
    global batch when every rank holds an equal slice. One fp32 all-reduce over every rank: the ranks of a
    sequence-parallel group hold the same value (the same samples), so the mean over all ranks is the same."""
    if group.dp_size == 1:
        return value
    total = value.detach().to(torch.float32) / group.ranks
    if group.shard_size > 1:
        total = _wait(torch.ops._c10d_functional.all_reduce(total, "sum", group.shard_name))
    if group.replicate_size > 1:
        total = _wait(torch.ops._c10d_functional.all_reduce(total, "sum", group.replicate_name))
    return total


def names_by_unit(names: Iterable[str], units: Sequence[str]) -> dict[str | None, list[str]]:
    """Param names grouped by their unit prefix (None: the root)."""
    out: dict[str | None, list[str]] = {None: [], **{prefix: [] for prefix in units}}
    for name in names:
        out[_unit_of(name, units)].append(name)
    return out
