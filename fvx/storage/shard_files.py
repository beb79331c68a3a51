"""fvx's checkpoint format: the state as per-rank safetensors files with JSON metadata, nothing pickled, a CRC-32 per
stored piece, and any region of any tensor read back on any number of processes (resharding N -> M).

Each rank of the first replica group writes ``rank-<i>-of-<N>.safetensors``: its unpadded slice of every tensor of a
``fvx.distributed.sharding.Shards`` (along that tensor's shard dim) and, on rank 0, every other tensor leaf whole. A
single process is the one-rank case: one file ``rank-00000-of-00001.safetensors`` holding every tensor whole. Tensors
are named by their state path joined with ``/`` (param names hold dots). The file's metadata entry ``fvx`` is JSON: per
tensor its full shape, dtype, sharded dim (None: whole), the slice ``[start, stop)`` along it and the CRC-32 of the
slice's bytes; on rank 0 the entry ``fvx_records`` holds the CRC-32 of the JSON records saved beside the state (the
checkpoint's config and meta, ``fvx.storage.files.json_checksum``), and ``fvx_crc32`` the CRC-32 of both entries, so a
flipped byte in a header is refused as such (files of fvx 0.1 have neither). :func:`read_region` assembles a region (a
range along one dim, or the whole tensor) from the pieces that overlap it, and checks every piece it reads against its
CRC: a flipped byte is refused by file and tensor name.
"""
from __future__ import annotations

import json
import pathlib
import zlib
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fvx.core import tree
from fvx.distributed import processes, sharding

SEPARATOR = "/"
META_KEY, RECORDS_KEY, HEADER_CRC_KEY = "fvx", "fvx_records", "fvx_crc32"
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                               torch.uint8, torch.bool)}


class CorruptShard(ValueError):
    """A shard file that is missing, unreadable, or whose bytes fail their checksum (the message names it)."""


class Piece(NamedTuple):
    """One stored slice of a tensor: the file and the name it is stored under there, the tensor's full shape and
    dtype, the sharded dim (None: whole), the slice along it and the CRC-32 of its bytes."""

    file: pathlib.Path
    name: str
    shape: tuple[int, ...]
    dtype: str
    dim: int | None
    start: int
    stop: int
    crc: int


def file_name(index: int, count: int) -> str:
    return f"rank-{index:05d}-of-{count:05d}.safetensors"


# ------------------------------------------------------------------------------------------------------- tensor bytes


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (zero-copy; bf16 as ``ml_dtypes.bfloat16``); other devices are copied to host."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes in C order (zlib's, about 2 GB/s; releases the GIL)."""
    return zlib.crc32(np.ascontiguousarray(as_numpy(tensor)).reshape(-1).view(np.uint8))


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in host memory, which later in-place updates of ``tensor`` do not touch."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory, contiguous: itself when it already is (no copy), else a copy."""
    return tensor.detach().cpu().contiguous()


# ------------------------------------------------------------------------------------------------------------ writing


def local_pieces(state: Any, mesh: Any = None, *, copy: bool = True) -> dict[str, tuple[torch.Tensor, dict]]:
    """This rank's pieces of ``state``: name -> (the contiguous host slice, its metadata record); empty on ranks
    outside the first replica group. Without a mesh (one process) every tensor is a whole piece. ``copy``: host
    copies, which later in-place updates of the state do not touch (an async save); else the tensors themselves
    where they are already contiguous in host memory."""
    index, count = (0, 1) if mesh is None else (mesh.get_local_rank(processes.SHARD), mesh.size(1))
    if mesh is not None and mesh.ndim > 1 and mesh.get_local_rank(processes.REPLICATE) != 0:
        return {}
    out: dict[str, tuple[torch.Tensor, dict]] = {}

    def record(name: str, part: torch.Tensor, shape, dim, start, stop) -> None:
        part = host_copy(part) if copy else on_host(part)
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
        elif not isinstance(node, torch.Tensor):
            raise TypeError(f"checkpoint: the state must hold tensors only; {'.'.join(path)!r} is a "
                            f"{type(node).__name__}")
    return out


def write(folder: pathlib.Path, pieces: Mapping[str, tuple[torch.Tensor, dict]], index: int, count: int,
          records: Mapping[str, int] | None = None) -> None:
    """This rank's file of ``pieces`` in ``folder``, each slice's record with its CRC-32, and ``records`` (name ->
    ``fvx.storage.files.json_checksum`` of the JSON records saved beside it; rank 0's); nothing when it holds no
    piece."""
    if not pieces:
        return
    tensors = {name: part for name, (part, _) in pieces.items()}
    header = {META_KEY: json.dumps({name: {**meta, "crc32": checksum(part)} for name, (part, meta) in pieces.items()}),
              RECORDS_KEY: json.dumps(dict(records or {}))}
    header[HEADER_CRC_KEY] = str(_header_crc(header))
    save_file(tensors, str(folder / file_name(index, count)), metadata=header)


def _header_crc(header: Mapping[str, str]) -> int:
    return zlib.crc32((header[META_KEY] + "\n" + header[RECORDS_KEY]).encode())


def _header(path: pathlib.Path) -> dict[str, str]:
    """A shard file's fvx metadata, its CRC checked (files of fvx 0.1 have none); a CorruptShard names the file."""
    try:
        with safe_open(str(path), "pt") as handle:
            header = handle.metadata() or {}
        json.loads(header[META_KEY])
    except Exception as error:
        raise CorruptShard(f"shard file {str(path)!r}: unreadable header ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if HEADER_CRC_KEY in header and (RECORDS_KEY not in header or str(_header_crc(header)) != header[HEADER_CRC_KEY]):
        raise CorruptShard(f"shard file {str(path)!r}: its header fails its checksum")
    return header


def record_checksums(folder: pathlib.Path) -> dict[str, int]:
    """The ``fvx.storage.files.json_checksum`` of each JSON record saved beside the state in ``folder`` (rank 0's file;
    empty
    for a checkpoint of fvx 0.1, which recorded none)."""
    header = _header(folder / file_name(0, _count(sorted(folder.glob("rank-*-of-*.safetensors")), folder)))
    return json.loads(header.get(RECORDS_KEY, "{}"))


# ------------------------------------------------------------------------------------------------------------ reading


def index(folder: pathlib.Path) -> dict[str, list[Piece]]:
    """Every stored piece by tensor name, from the files' JSON headers (no tensor is read)."""
    files = sorted(folder.glob("rank-*-of-*.safetensors"))
    _count(files, folder)
    out: dict[str, list[Piece]] = {}
    for f in files:
        records = json.loads(_header(f)[META_KEY])
        for name, r in records.items():
            out.setdefault(name, []).append(Piece(f, name, tuple(r["shape"]), r["dtype"], r["dim"], r["start"],
                                                  r["stop"], r["crc32"]))
    for name, pieces in out.items():
        _check_complete(name, pieces, folder)
    return out


def _count(files: list[pathlib.Path], folder: pathlib.Path) -> int:
    """The world size that wrote ``files``, the shard files of one checkpoint (a CorruptShard when there are none or
    they disagree)."""
    if not files:
        raise CorruptShard(f"{str(folder)!r} holds no shard files")
    counts = {f.name.rsplit("-of-", 1)[1].split(".")[0] for f in files}
    if len(counts) != 1 or len(files) > int(next(iter(counts))):
        raise CorruptShard(f"{str(folder)!r} mixes shard files of different world sizes")
    return int(next(iter(counts)))


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
        raise CorruptShard(f"{str(folder)!r} lacks part of {name!r} (rows {end}.. of "
                           f"{first.shape[first.dim]} along dim {first.dim}: a shard file is missing)")


def read_region(pieces: Iterable[Piece], dim: int | None = None, start: int = 0,
                stop: int | None = None) -> torch.Tensor:
    """The tensor the ``pieces`` store, or only its rows ``[start, stop)`` along ``dim``, as a new CPU tensor. Only
    the pieces that overlap the region are read, each checked against its CRC."""
    pieces = list(pieces)
    shape, dtype = pieces[0].shape, DTYPES[pieces[0].dtype]
    if not shape:  # a 0-dim leaf (the step), stored whole
        return _read_piece(pieces[0]).clone()
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
        src, dst = _read_piece(piece), out
        for k, (lo, hi) in enumerate(overlap):
            src = src.narrow(k, lo - box[k][0], hi - lo)
            dst = dst.narrow(k, lo - region[k][0], hi - lo)
        dst.copy_(src)
    return out


def _read_piece(piece: Piece) -> torch.Tensor:
    try:
        with safe_open(str(piece.file), "pt") as handle:
            part = handle.get_tensor(piece.name)
    except Exception as error:
        raise CorruptShard(f"shard file {str(piece.file)!r}: cannot read {piece.name!r} ({type(error).__name__})") \
            from None
    if checksum(part) != piece.crc:
        raise CorruptShard(f"shard file {str(piece.file)!r}: tensor {piece.name!r} fails its checksum")
    return part


Region = Callable[[str, "int | None", int, "int | None"], torch.Tensor]  # (name, dim, start, stop) -> CPU tensor


def read_into(region: Region, target: Any, mesh: Any = None) -> Any:
    """A new state structured like ``target``, each tensor read by ``region(name, dim, start, stop)`` (its name
    the target's path joined with ``/``; ``dim`` None: the whole tensor): on a mesh each ``Shards`` tensor as this
    rank's zero-padded slice of its own layout (whatever world size saved it), other leaves whole, on the target's
    devices."""
    index, count = (0, 1) if mesh is None else (mesh.get_local_rank(processes.SHARD), mesh.size(1))

    def fill(path: tuple[str, ...], node: Any) -> Any:
        prefix = SEPARATOR.join(path)
        if isinstance(node, sharding.Shards):
            out = {}
            for param, local in node.items():
                if local is None:
                    out[param] = None
                    continue
                spec = node.layout[param]
                start, real = sharding.local_rows(spec, index, count)
                fresh = torch.zeros_like(local)
                if real:
                    rows = region(f"{prefix}{SEPARATOR}{param}", spec.dim, start, start + real)
                    fresh.narrow(spec.dim, 0, real).copy_(rows)
                out[param] = fresh
            return sharding.Shards(out, node.layout)
        if isinstance(node, torch.Tensor):
            return torch.empty_like(node).copy_(region(prefix, None, 0, None).reshape(node.shape))
        return node

    return tree.map_with_path(fill, target, is_leaf=lambda n: isinstance(n, sharding.Shards))
