"""The processes of a run: joining torchrun's process group, the device mesh and its groups, and the small
collectives ranks agree through (a global norm, a metric's mean, the largest of an integer, a flag, an error).

A run of several processes joins one process group (NCCL on GPUs, gloo on CPUs) and lays its ranks out on a
``(replicate, shard)`` mesh (HSDP; ``replicate=1`` is plain FSDP: ``fvx.distributed.sharding``), optionally with groups
of sequence-parallel ranks (``fvx.distributed.sequence_parallel``). What compiled code and collectives need of the mesh
is a :class:`Group`: process-group names and sizes, plain data. It is also the ``fvx.core.role.Ranks`` a role's numbers
combine over.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fvx.core.tree import global_norm, tensor_leaves
from fvx.distributed import sequence_parallel as fsp

REPLICATE, SHARD = "replicate", "shard"  # mesh dimension names


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
    """A ``(replicate, shard)`` device mesh over all processes (HSDP; ``replicate=1`` is plain FSDP). ``shard`` defaults
    to world / replicate; ``device_type`` to cuda where available, else cpu. ``sp`` > 1 also makes the sequence-parallel
    groups of ``sp`` consecutive ranks (``fvx.distributed.sequence_parallel``; the ranks of one hold the same samples)
    and records them on the mesh, where :func:`group_of` and :func:`sequence_group` read them; the params still shard
    over the whole mesh as without SP."""
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


_SEQUENCE = "_fvx_sequence_group"  # the mesh attribute holding its fvx.distributed.sequence_parallel.SPGroup


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

    def global_norm(self, tree: Any) -> torch.Tensor:
        """The 2-norm over every rank's shards of ``tree`` (:func:`global_norm_sharded`), as ``fvx.core.role.Ranks``
        asks."""
        return global_norm(tree) if self.ranks == 1 else global_norm_sharded(tree, self)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """:func:`dp_mean` of a per-rank metric."""
        return dp_mean(value, self)

    def max(self, value: int) -> int:
        """:func:`dp_max` of a per-rank integer."""
        return dp_max(value, self)

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """:func:`dp_gather` of per-rank rows."""
        return dp_gather(value, self)


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


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# ------------------------------------------------------------------------------------------------ small collectives


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, once it has arrived."""
    return torch.ops._c10d_functional.wait_tensor(tensor)


def global_norm_sharded(tree: Any, group: Group) -> torch.Tensor:
    """sqrt of the sum of squares over all ranks' shards of ``tree`` (DTensors or local shards; every leaf a shard of
    a sharded tensor, replicas identical): one fp32 ``all_reduce`` over the shard group. 0-dim fp32."""
    leaves = [x.to_local() if isinstance(x, DTensor) else x for x in tensor_leaves(tree)]
    leaves = [x.detach() for x in leaves if x.is_floating_point()]
    if leaves:
        norms = torch._foreach_norm(leaves, 2.0)
        squares = torch.stack([n.to(torch.float32) for n in norms]).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float32)
    if group.shard_size > 1:
        squares = wait(torch.ops._c10d_functional.all_reduce(squares, "sum", group.shard_name))
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
            total = wait(torch.ops._c10d_functional.all_reduce(total, "max", name))
    return int(total)


def dp_mean(value: torch.Tensor, group: Group) -> torch.Tensor:
    """The mean of a per-rank metric (a local loss) over the data-parallel ranks: what one process would log for the
    global batch when every rank holds an equal slice. One fp32 all-reduce over every rank: the ranks of a
    sequence-parallel group hold the same value (the same samples), so the mean over all ranks is the same."""
    if group.dp_size == 1:
        return value
    total = value.detach().to(torch.float32) / group.ranks
    if group.shard_size > 1:
        total = wait(torch.ops._c10d_functional.all_reduce(total, "sum", group.shard_name))
    if group.replicate_size > 1:
        total = wait(torch.ops._c10d_functional.all_reduce(total, "sum", group.replicate_name))
    return total


def dp_gather(value: torch.Tensor, group: Group) -> torch.Tensor:
    """Every data-parallel rank's rows ``value [n, ...]`` (equal ``n``) concatenated along dim 0 in data-parallel rank
    order, on every rank: an all-gather over the shard group, then over the replicate group (global rank order), then
    one copy per sequence-parallel group (its ranks hold the same samples)."""
    if group.ranks == 1:
        return value
    out = value.detach().contiguous()
    for name, size in ((group.shard_name, group.shard_size), (group.replicate_name, group.replicate_size)):
        if size > 1:
            out = wait(torch.ops._c10d_functional.all_gather_into_tensor(out, size, name))
    if group.sp_size > 1:
        out = out.view(group.dp_size, group.sp_size, *value.shape)[:, 0].reshape(-1, *value.shape[1:])
    return out
