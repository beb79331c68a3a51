"""Sharded state as per-rank safetensors files with JSON metadata: nothing pickled, a CRC-32 per stored piece, and any
region of any tensor read back on any number of processes (resharding N -> M).

Each rank of the first replica group writes ``rank-<i>-of-<N>.safetensors``: its unpadded slice of every tensor of a
``fvx.sharding.Shards`` (along that tensor's shard dim) and, on rank 0, every other tensor leaf whole. Tensors are
named by their state path joined with ``/`` (param names hold dots). The file's metadata entry ``fvx`` is JSON: per
tensor its full shape, dtype, sharded dim (None: whole), the slice ``[start, stop)`` along it and the CRC-32 of the
slice's bytes. :func:`read_region` assembles a region (a range along one dim, or the whole tensor) from the pieces
that overlap it, and checks every piece it reads against its CRC: a flipped byte is refused by file and tensor name.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable, Mapping, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fvx import sharding, tree

SEPARATOR = "/"
META_KEY = "fvx"
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                               torch.uint8, torch.bool)}


class CorruptShard(ValueError):
    """A shard file that is missing, unreadable, or whose bytes fail their checksum (the message names it)."""


class Piece(NamedTuple):
    """One stored slice of a tensor: the file, the tensor's full shape and dtype, the sharded dim (None: whole), the
    slice along it and the CRC-32 of its bytes."""

    file: pathlib.Path
    shape: tuple[int, ...]
    dtype: str
    dim: int | None
    start: int
    stop: int
    crc: int


def file_name(index: int, count: int) -> str:
    return f"rank-{index:05d}-of-{count:05d}.safetensors"


def local_pieces(state: Any, mesh: Any) -> dict[str, tuple[torch.Tensor, dict]]:
    """This rank's pieces of ``state``: name -> (the contiguous host slice, its metadata record); empty on ranks
    outside the first replica group."""
    from fvx.checkpoint import host_copy  # the host copy single-process checkpoints use

    index, count = mesh.get_local_rank(sharding.SHARD), mesh.size(1)
    if mesh.ndim > 1 and mesh.get_local_rank(sharding.REPLICATE) != 0:
        return {}
    out: dict[str, tuple[torch.Tensor, dict]] = {}

    def record(name: str, part: torch.Tensor, shape, dim, start, stop) -> None:
        part = host_copy(part)
        out[name] = (part, {"shape": list(shape), "dtype": str(part.dtype), "dim": dim, "start": start, "stop": stop})

    for path, node in tree.named_leaves(state, is_leaf=lambda n: isinstance(n, sharding.Shards)):
        prefix = SEPARATOR.join(path)
        if isinstance(node, sharding.Shards):
            for param, local in node.items():
                if local is None:
                    continue
                spec = node.layout[param]
                start, real = sharding.local_rows(spec, index, count)
                if real:
                    record(f"{prefix}{SEPARATOR}{param}", local.narrow(spec.dim, 0, real), spec.shape, spec.dim, start,
                           start + real)
        elif isinstance(node, torch.Tensor) and index == 0:
            record(prefix, node, tuple(node.shape), None, 0, 0)
    return out


def write(folder: pathlib.Path, pieces: Mapping[str, tuple[torch.Tensor, dict]], index: int, count: int) -> None:
    """This rank's file of ``pieces`` in ``folder``, each slice's record with its CRC-32 (nothing when it holds
    none)."""
    if not pieces:
        return
    from fvx.checkpoint import checksum  # the CRC single-process checkpoints use

    tensors = {name: part for name, (part, _) in pieces.items()}
    records = {name: {**meta, "crc32": checksum(part)} for name, (part, meta) in pieces.items()}
    save_file(tensors, str(folder / file_name(index, count)), metadata={META_KEY: json.dumps(records)})


def index(folder: pathlib.Path) -> dict[str, list[Piece]]:
    """Every stored piece by tensor name, from the files' JSON headers (no tensor is read)."""
    files = sorted(folder.glob("rank-*-of-*.safetensors"))
    if not files:
        raise CorruptShard(f"sharded checkpoint {str(folder)!r} holds no shard files")
    counts = {f.name.rsplit("-of-", 1)[1].split(".")[0] for f in files}
    expected = int(next(iter(counts)))
    if len(counts) != 1 or len(files) > expected:
        raise CorruptShard(f"sharded checkpoint {str(folder)!r} mixes shard files of different world sizes")
    out: dict[str, list[Piece]] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as handle:
                records = json.loads((handle.metadata() or {})[META_KEY])
        except Exception as error:
            raise CorruptShard(f"shard file {str(f)!r} is corrupt or truncated ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''})") from None
        for name, r in records.items():
            out.setdefault(name, []).append(Piece(f, tuple(r["shape"]), r["dtype"], r["dim"], r["start"], r["stop"],
                                                  r["crc32"]))
    for name, pieces in out.items():
        _check_complete(name, pieces, folder)
    return out


def _check_complete(name: str, pieces: list[Piece], folder: pathlib.Path) -> None:
    """A CorruptShard unless the pieces of ``name`` cover it exactly once (a shard file deleted, say)."""
    first = pieces[0]
    if first.dim is None:
        return
    covered = sorted((p.start, p.stop) for p in pieces)
    end = 0
    for start, stop in covered:
        if start != end:
            break
        end = stop
    if end != first.shape[first.dim]:
        raise CorruptShard(f"sharded checkpoint {str(folder)!r} lacks part of {name!r} (rows {end}.. of "
                           f"{first.shape[first.dim]} along dim {first.dim}: a shard file is missing)")


def read_region(pieces: Iterable[Piece], name: str, dim: int | None = None, start: int = 0,
                stop: int | None = None) -> torch.Tensor:
    """Tensor ``name`` (from its pieces), or only its rows ``[start, stop)`` along ``dim``, as a new CPU tensor.
    Only the pieces that overlap the region are read, each checked against its CRC."""
    pieces = list(pieces)
    shape, dtype = pieces[0].shape, DTYPES[pieces[0].dtype]
    if not shape:  # a 0-dim leaf (the step), stored whole
        return _read_piece(pieces[0], name).clone()
    region = [(0, size) for size in shape]
    if dim is not None:
        region[dim] = (start, shape[dim] if stop is None else stop)
    out = torch.zeros([hi - lo for lo, hi in region], dtype=dtype)
    for piece in pieces:
        box = [(0, size) for size in shape]
        if piece.dim is not None:
            box[piece.dim] = (piece.start, piece.stop)
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, box)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        src, dst = _read_piece(piece, name), out
        for k, (lo, hi) in enumerate(overlap):
            src = src.narrow(k, lo - box[k][0], hi - lo)
            dst = dst.narrow(k, lo - region[k][0], hi - lo)
        dst.copy_(src)
    return out


def _read_piece(piece: Piece, name: str) -> torch.Tensor:
    from fvx.checkpoint import checksum

    try:
        with safe_open(str(piece.file), "pt") as handle:
            part = handle.get_tensor(name)
    except Exception as error:
        raise CorruptShard(f"shard file {str(piece.file)!r} is corrupt or truncated: cannot read {name!r} "
                           f"({type(error).__name__})") from None
    if checksum(part) != piece.crc:
        raise CorruptShard(f"shard file {str(piece.file)!r}: tensor {name!r} fails its checksum (the file is "
                           "corrupt)")
    return part


def read_into(stored: Mapping[str, list[Piece]], target: Any, mesh: Any = None) -> Any:
    """A new state structured like ``target`` read from the pieces ``stored``: on a mesh each ``Shards`` tensor as
    this rank's zero-padded slice of its own layout (whatever world size saved it), other leaves whole."""
    index, count = (0, 1) if mesh is None else (mesh.get_local_rank(sharding.SHARD), mesh.size(1))

    def fill(path: tuple[str, ...], node: Any) -> Any:
        prefix = SEPARATOR.join(path)
        if isinstance(node, sharding.Shards):
            out = {}
            for param, local in node.items():
                if local is None:
                    out[param] = None
                    continue
                spec, name = node.layout[param], f"{prefix}{SEPARATOR}{param}"
                start, real = sharding.local_rows(spec, index, count)
                fresh = torch.zeros_like(local)
                if real:
                    rows = read_region(stored[name], name, spec.dim, start, start + real)
                    fresh.narrow(spec.dim, 0, real).copy_(rows)
                out[param] = fresh
            return sharding.Shards(out, node.layout)
        if isinstance(node, torch.Tensor):
            return torch.empty_like(node).copy_(read_region(stored[prefix], prefix).reshape(node.shape))
        return node

    return tree.map_with_path(fill, target, is_leaf=lambda n: isinstance(n, sharding.Shards))
