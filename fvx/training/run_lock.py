"""One writer per run folder: a lock file ``<run>/.fvx-lock`` (pid, host, start time) made atomically by the process
that trains there, removed when it stops. A second process refuses the folder, naming the holder; a lock whose
process is gone (same host, no such pid) is stale and taken over.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import socket

LOCK_FILE = ".fvx-lock"


class RunLockError(ValueError):
    """The run folder is in use by another process; the message names it."""


def _holder(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return {}  # unreadable: treated as held, named by its file


def _alive(holder: dict) -> bool:
    """Whether the holder may still run: another host's cannot be checked, so it counts as alive."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check(run_dir: pathlib.Path) -> None:
    """A :class:`RunLockError` when a live process holds ``run_dir`` (nothing is written)."""
    holder = _holder(run_dir / LOCK_FILE)
    if holder is not None and _alive(holder) and holder.get("pid") != os.getpid():
        raise RunLockError(_message(run_dir, holder))


def _message(run_dir: pathlib.Path, holder: dict) -> str:
    who = (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}" if holder
           else "a process whose lock file cannot be read")
    return (f"run folder {str(run_dir)!r} is in use by {who} ({str(run_dir / LOCK_FILE)!r}); stop that run first, "
            "or train in another folder (delete the lock file only if that process is gone)")


def acquire(run_dir: pathlib.Path) -> pathlib.Path:
    """Take ``run_dir``'s lock (creating the folder), taking over a stale one; a :class:`RunLockError` when a live
    process holds it. Returns the lock file, for :func:`release`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": datetime.datetime.now().isoformat(timespec="seconds")})
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is not None and _alive(holder):
                raise RunLockError(_message(run_dir, holder)) from None
            path.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(record + "\n")
        return path
    raise RunLockError(_message(run_dir, _holder(path) or {}))


def release(path: pathlib.Path) -> None:
    """Remove the lock this process holds (not another's)."""
    holder = _holder(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def held(run_dir: pathlib.Path):
    """``run_dir``'s lock (:func:`acquire`) for the duration of a ``with``, released on the way out."""
    path = acquire(run_dir)
    try:
        yield path
    finally:
        release(path)
