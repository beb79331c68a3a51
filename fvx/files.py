"""Durable small-file writes: a file is either its old content, or its whole new content, never a torn one."""
from __future__ import annotations

import os
import pathlib


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
