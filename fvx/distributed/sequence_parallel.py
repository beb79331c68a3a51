"""Ulysses-style sequence parallelism (SP): the ranks of an SP group hold the same samples and split their tokens.

Each rank of a group of ``P`` holds one contiguous run of every sample's flattened token sequence, tokens
``[r L/P, (r+1) L/P)`` for group rank ``r``. Whatever a transformer does token by token (norms, modulation, the
feed-forward, cross-attention to the text) runs on the rank's own tokens. Self-attention needs every token, so it
turns ``[B, L/P, H, D]`` (tokens split, all heads) into ``[B, L, H/P, D]`` (all tokens, the rank's heads) with one
all-to-all (:func:`to_heads`), attends exactly as one process would for those heads, and turns back with another
(:func:`to_tokens`). A family says where its token sequence starts and ends (:func:`split_tokens` after its patch
embedding, :func:`gather_tokens` before it unpatchifies) and swaps its self-attention; ``fvx_models`` installs that.

Gradients. What runs before the split and after the gather is replicated: every rank of the group computes it on the
same inputs (the same samples and per-sample keys, which come from the global sample index), to the same values.
:func:`split_tokens` is a slice, so its backward hands the replicated part this rank's tokens' gradient (zeros
elsewhere); :func:`gather_tokens`' backward takes this rank's slice of the output gradient, which is the same on every
rank. Each rank's parameter gradients are then its tokens' share of one process's, and their sum over the group is
the whole: ``fvx.distributed.sharding``'s reduce-scatter sums over every rank and divides by the data-parallel size only
(``Group.dp_size``, the ranks divided by ``P``).

Collectives are the functional ones addressed by process-group name (compiled graphs hold no group object), inside
``autograd.Function``s whose backward is the transposed collective.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class SPGroup(NamedTuple):
    """One SP group as plain data: its process-group ``name``, ``size`` and this process's ``rank`` in it.
    ``SPGroup()`` is no sequence parallelism (every function below is then the identity)."""

    name: str = ""
    size: int = 1
    rank: int = 0


def make_group(size: int) -> SPGroup:
    """The SP group of this process: consecutive ranks ``[k size, (k+1) size)`` form group ``k``, so ``rank // size``
    is the data-parallel rank. Every process of the default group must call it (it creates process groups)."""
    if not dist.is_initialized():
        raise ValueError("sequence parallel: torch.distributed is not initialised (launch with torchrun)")
    world = dist.get_world_size()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"sequence parallel: --sp {size!r} must be a positive divisor of the world size {world} "
                         f"(the processes torchrun starts); choose one of {divisors(world)}")
    if size == 1:
        return SPGroup()
    group, _ = dist.new_subgroups(group_size=size)
    return SPGroup(group.group_name, size, dist.get_rank() % size)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(heads: int, group: SPGroup, who: str) -> None:
    """A ValueError unless ``heads`` attention heads split evenly over the group (Ulysses splits heads)."""
    if heads % group.size:
        raise ValueError(f"{who}: sequence parallelism over {group.size} ranks splits the {heads} attention heads, "
                         f"which {group.size} does not divide; use --sp {' or '.join(map(str, divisors(heads)))}")


def local_tokens(count: int, group: SPGroup) -> tuple[int, int]:
    """``(start, length)`` of this rank's tokens among ``count``; a ValueError says what to change when ``count``
    does not split evenly."""
    if count % group.size:
        raise ValueError(f"sequence parallel: {count} tokens per sample do not split over --sp {group.size} ranks; "
                         f"choose a video size (or frame count) whose tokens after patching divide by {group.size}, "
                         f"or an --sp that divides {count}")
    length = count // group.size
    return group.rank * length, length


def split_tokens(x: torch.Tensor, group: SPGroup, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (a view). Its backward is the slice's: this rank's gradient, zeros
    for the other ranks' tokens."""
    if group.size == 1:
        return x
    start, length = local_tokens(x.shape[dim], group)
    return x.narrow(dim, start, length)


def gather_tokens(x: torch.Tensor, group: SPGroup, dim: int = 1) -> torch.Tensor:
    """Every rank's tokens of ``x`` along ``dim``, in rank order (one all-gather). Its backward is this rank's slice
    of the output gradient: what follows the gather must run alike on every rank of the group (module docstring)."""
    if group.size == 1:
        return x
    return _GatherTokens.apply(x, dim, tuple(group))


def to_heads(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    """``[B, L/P, *, H, D]`` (this rank's tokens, all heads) -> ``[B, L, *, H/P, D]`` (all tokens, this rank's heads
    ``[r H/P, (r+1) H/P)``): one all-to-all; its backward is :func:`to_tokens`."""
    if group.size == 1:
        return x
    if x.shape[-2] % group.size:
        raise ValueError(f"sequence parallel: {x.shape[-2]} heads do not split over --sp {group.size} ranks")
    return _AllToAll.apply(x, True, tuple(group))


def to_tokens(x: torch.Tensor, group: SPGroup) -> torch.Tensor:
    """``[B, L, *, H/P, D]`` -> ``[B, L/P, *, H, D]``, the inverse of :func:`to_heads` (and its backward)."""
    if group.size == 1:
        return x
    local_tokens(x.shape[1], group)
    return _AllToAll.apply(x, False, tuple(group))


# ------------------------------------------------------------------------------------------------------ collectives


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(tensor)


def _all_to_all(blocks: torch.Tensor, name: str, size: int) -> torch.Tensor:
    """``blocks [P, ...]``: block ``j`` goes to rank ``j``; the result's block ``i`` came from rank ``i``."""
    splits = [blocks.shape[0] // size] * size
    return _wait(torch.ops._c10d_functional.all_to_all_single(blocks.contiguous(), splits, splits, name))


def _heads_of(x: torch.Tensor, name: str, size: int) -> torch.Tensor:
    b, n, *mid, h, d = x.shape
    blocks = x.reshape(b, n, *mid, size, h // size, d).movedim(-3, 0)  # [P, B, L/P, *, H/P, D]: heads chunk j
    out = _all_to_all(blocks, name, size)  # block i: rank i's tokens
    return out.movedim(0, 1).reshape(b, size * n, *mid, h // size, d)


def _tokens_of(x: torch.Tensor, name: str, size: int) -> torch.Tensor:
    b, n, *mid, h, d = x.shape
    blocks = x.reshape(b, size, n // size, *mid, h, d).movedim(1, 0)  # [P, B, L/P, *, H/P, D]: tokens chunk j
    out = _all_to_all(blocks, name, size)  # block i: heads chunk i of this rank's tokens
    return out.movedim(0, -3).reshape(b, n // size, *mid, size * h, d)


class _AllToAll(torch.autograd.Function):
    """:func:`to_heads` (``heads=True``) or :func:`to_tokens`; the backward runs the other direction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, heads: bool, group: tuple):
        ctx.heads, ctx.group = heads, group
        name, size, _ = group
        return _heads_of(x, name, size) if heads else _tokens_of(x, name, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        name, size, _ = ctx.group
        return (_tokens_of(grad, name, size) if ctx.heads else _heads_of(grad, name, size)), None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: one all-gather of the tokens along ``dim``. Backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: tuple):
        name, size, rank = group
        ctx.dim, ctx.start, ctx.length = dim, rank * x.shape[dim], x.shape[dim]
        rows = x.movedim(dim, 0).contiguous()
        full = _wait(torch.ops._c10d_functional.all_gather_into_tensor(rows, size, name))
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None
