"""Durable small-file writes: a file is either its old content, or its whole new content, never a torn one."""
from __future__ import annotations

import json
import os
import pathlib
import zlib
from typing import Any


def write_atomic(path: pathlib.Path, payload: bytes) -> None:
    """``payload`` at ``path`` or nothing new there: a temporary file beside it (``.NAME.PID.tmp``, named by this
    process), fsync, rename over ``path``, fsync of the folder (so a kill at any point leaves no partial file)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def json_checksum(record: Any) -> int:
    """CRC-32 of a JSON record in its canonical form (sorted keys, no spaces): the same for the record as written and
    as read back, whatever whitespace the writer used."""
    return zlib.crc32(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())


def json_bytes(record: Any) -> bytes:
    """``record`` as the JSON fvx writes: indented, with a final newline."""
    return (json.dumps(record, indent=2) + "\n").encode()


def write_json(path: pathlib.Path, record: Any) -> None:
    """``record`` as JSON at ``path`` (:func:`json_bytes`), atomically (:func:`write_atomic`), its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json_bytes(record))
