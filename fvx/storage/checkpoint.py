"""Checkpoints of the training state, on orbax-checkpoint's ``CheckpointManager``.

A checkpoint is a folder ``<directory>/<step>/``, ``step`` being the number of steps taken (the state's ``step``: the
state a run resumed from it continues with step ``step``). It holds three orbax items:

    shards/     the state: one safetensors file per rank of its pieces, JSON metadata and a CRC-32 per piece
                (``fvx.storage.shard_files``; a single process writes the one-rank case, every tensor whole)
    config/     the resolved config (JSON, as ``fvx.config.dump`` writes it)
    meta/       run metadata: fvx, torch and diffusers versions, step, world size, how the run was started (JSON)

One format for one process and many: a checkpoint saved on N processes restores on M (any region of any tensor reads
back from the pieces that overlap it), into local shards on a mesh or into whole tensors in one process (resume, replay,
export), and every piece read is checked against its CRC, so a flipped byte is refused by file and tensor name.
Checkpoints of earlier fvx versions (tensorstore ``state/`` with ``checksums/``; AdamW's state before it was a chain)
still read (``fvx.storage.legacy_checkpoint``); loading reads JSON and raw tensor bytes only, nothing is unpickled.
Restoring checks the stored tree against a target state (names, shapes, dtypes; every difference listed).

Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it once every item is complete, so a save killed
half-way leaves a temporary folder that listing and restoring never see; a writing :class:`Checkpoints` deletes such
folders when it opens (before any save, so that step can be saved again). A step then counts only once fvx has
*committed* it: every file and folder of it flushed to disk (``fsync``) by every rank, then the marker file
``fvx-committed`` written and flushed, so a committed checkpoint survives power loss (orbax itself flushes nothing).
Retention (keep the newest K, and every M-th for good) is fvx's, applied only after a newer checkpoint is committed.
A save that fails (no space left, any I/O error) raises a :class:`CheckpointWriteError` naming the folder and the
bytes it needed; the uncommitted folder it leaves is never listed and is cleared by the next writer.

Async saves and donation. The training step updates the state's tensors in place, so an async save must not write
from them: :meth:`Checkpoints.save` first copies this rank's pieces to host memory (a CPU clone, or the
device-to-host copy a GPU state needs anyway), then a thread writes them (the CRCs computed there), flushes and
commits while training goes on. Waiting for the save before the next step instead would overlap nothing, since that
step updates the state at once. Measured on 2 CPU cores: a 1.2 GB state blocks training for 0.19 s (0.10 s of it the
copy) of a 1.4 s save. A synchronous save writes straight from the state's own memory where it is contiguous in
host memory, and returns once the step folder is committed.

On a mesh (``Checkpoints(..., mesh=)``, the state holding ``fvx.distributed.sharding.Shards``, each with its own layout)
all processes call every method in the same order (orbax barriers through ``jax.distributed``, which must be
initialised: ``fvx.distributed.processes.init_jax_distributed``), and the commit thread's barriers use a process group
of their own (never the one the training step's collectives use), so ranks agree without the training loop waiting.
Opening a manager (not importing this module) keeps JAX off the accelerators torch uses (``jax_platforms`` cpu unless
``JAX_PLATFORMS`` says otherwise), quiets orbax's warnings about choices fvx makes on purpose, and drops the late "Event
loop is closed" reports of tensorstore after a failed read.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import threading
from types import ModuleType
from typing import Any, Mapping, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from fvx.core import tree
from fvx.distributed import processes, sharding
from fvx.storage import files, legacy_checkpoint as legacy, shard_files
from fvx.storage.checkpoint_config import CheckpointConfig

TMP_SUFFIX = ".orbax-checkpoint-tmp"
_LIST_LIMIT = 10  # names shown per category in an error message
_JSON_ITEMS = ("config", "meta")
SHARDS_ITEM = "shards"  # the item holding the state (``fvx.storage.orbax_items.SHARDS_ITEM``)
LEGACY_DCP_ITEM = "dcp"  # sharded state of earlier fvx versions: pickled metadata, never read
STATE_ITEMS = (SHARDS_ITEM, legacy.STATE_ITEM)  # where a checkpoint folder holds its state, by format


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, corrupt, or does not fit the state it is restored into."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint whose tree does not fit the state it is restored into (another config or model)."""


class CheckpointWriteError(RuntimeError):
    """A save failed (a full disk, an I/O error); earlier checkpoints are intact. The message names the folder."""


COMMIT_FILE = "fvx-committed"


class TensorSpec(NamedTuple):
    """What a checkpoint records of one tensor."""

    shape: tuple[int, ...]
    dtype: np.dtype


class _QuietOrbax(logging.Filter):
    """Drops orbax warnings about choices fvx makes on purpose: a registry without jax.Array (fvx keeps no array
    metadata) and read-only managers."""

    BENIGN = ("No jax.Array in TypeHandlerRegistry", "read_only=True, setting save_interval_steps",
              "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.BENIGN)



# ---------------------------------------------------------------------------------------------------- tree names


def leaves_by_path(state: Any) -> dict[tuple[str, ...], Any]:
    """The leaves of a pytree by path of key names (``("roles", "student", "opt_state", "0", "mu", <param>)``)."""
    return dict(tree.named_leaves(state))


def leaves_by_name(state: Any) -> dict[str, Any]:
    """The leaves of a pytree by dotted path (``roles.student.opt_state.0.mu.<param>``)."""
    by_path = leaves_by_path(state)
    named = {".".join(path): leaf for path, leaf in by_path.items()}
    if len(named) != len(by_path):
        raise ValueError("checkpoint: two leaves of the state have the same dotted name (keys containing dots?)")
    return named


def _dtype(torch_dtype: torch.dtype) -> np.dtype:
    return shard_files.as_numpy(torch.empty(0, dtype=torch_dtype)).dtype


def _specs(state: Any) -> dict[str, TensorSpec]:
    """Stored name (path joined with ``/``) -> shape and dtype of every leaf (a DTensor's are its global ones)."""
    specs = {}
    for path, leaf in tree.named_leaves(state):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"checkpoint: the state must hold tensors only; {'.'.join(path)!r} is a "
                            f"{type(leaf).__name__}")
        specs[shard_files.SEPARATOR.join(path)] = TensorSpec(tuple(leaf.shape), _dtype(leaf.dtype))
    return specs


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


def _dotted(name: str) -> str:
    return name.replace(shard_files.SEPARATOR, ".")


def match_names(stored: Mapping[str, TensorSpec], target: Mapping[str, TensorSpec], where: str) -> dict[str, str]:
    """Target name -> the stored name it reads (itself, or an earlier version's name for it:
    ``fvx.storage.legacy_checkpoint.stored_name``); a CheckpointMismatch listing missing and unexpected tensors and
    shape or dtype mismatches."""
    matched = {name: legacy.stored_name(name, stored, shard_files.SEPARATOR) for name in target}
    missing = [_dotted(name) for name, old in matched.items() if old is None]
    unexpected = [_dotted(name) for name in stored if name not in set(matched.values())]
    mismatched = [f"{_dotted(name)}: checkpoint {list(stored[old].shape)} {stored[old].dtype}, run "
                  f"{list(spec.shape)} {spec.dtype}" for name, spec in target.items()
                  if (old := matched[name]) is not None and stored[old] != spec]
    problems = [f"{label} ({len(items)}): {_listed(items)}"
                for label, items in (("missing in the checkpoint", missing), ("not in this run's state", unexpected),
                                     ("shape or dtype mismatches", mismatched)) if items]
    if problems:
        raise CheckpointMismatch(f"{where} does not fit this run's state: " + "; ".join(problems))
    return matched


# ------------------------------------------------------------------------------------------------------ the manager


@functools.cache
def _orbax() -> ModuleType:
    """``fvx.storage.orbax_items`` (and with it orbax and JAX), imported once per process when the first manager
    opens: JAX kept on the CPU (orbax only needs it for its bookkeeping; ``JAX_PLATFORMS`` overrides), orbax's benign
    warnings filtered, and tensorstore's late reports after a failed read dropped (:func:`_quiet_late_reads`)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.getLogger("absl").addFilter(_QuietOrbax())
    _quiet_late_reads()
    from fvx.storage import orbax_items  # the one module that imports orbax

    return orbax_items


class Checkpoints:
    """The checkpoints in one folder. ``Checkpoints(directory, config)`` saves (and deletes what retention drops);
    ``Checkpoints(directory)`` only reads. Use as a context manager, or call :meth:`close` (it waits for saves).

    With ``mesh`` (``fvx.distributed.processes.make_mesh``) the states saved and restored hold this rank's ``Shards``,
    and every process of the mesh makes the same calls (module docstring)."""

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig | None = None, *, mesh: Any = None):
        self.directory = pathlib.Path(directory).absolute()
        self.config = config
        self._mesh = mesh
        self._manager = None
        self._failed = False  # a save failed (reported once)
        self._pending: _Pending | None = None  # an async save, written and committed by its own thread
        # the commit's barriers: a group of their own, as an async save's thread runs them beside the step's collectives
        self._barriers = dist.new_group(backend="gloo") if config is not None and mesh is not None else None
        if config is None and not self.directory.is_dir():
            return  # nothing to read: steps() is empty
        items = _orbax()
        if config is not None and self.directory.is_dir() and _primary():
            for unfinished in self.directory.glob(f"*{TMP_SUFFIX}*"):
                shutil.rmtree(unfinished, ignore_errors=True)
            for step_dir in self.directory.iterdir():  # complete in orbax's eyes, never committed: not a checkpoint
                if step_dir.name.isdigit() and not (step_dir / COMMIT_FILE).is_file():
                    shutil.rmtree(step_dir, ignore_errors=True)
        self._manager = items.manager(self.directory, read_only=config is None)

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Wait for a pending save and commit it, then release orbax's resources."""
        if self._manager is not None:
            try:
                self.wait()
            finally:
                manager, self._manager = self._manager, None
                try:
                    manager.close()
                except Exception:  # orbax re-raises a failed save that wait() has reported already
                    if not self._failed:
                        raise

    def wait(self) -> None:
        """Block until a pending async save is written and committed (a :class:`CheckpointWriteError` if it
        failed), then apply retention."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        if pending.error is not None:
            raise self._write_error(pending.step, pending.size, pending.error) from None
        self._apply_retention()

    def poll(self) -> None:
        """Raise the :class:`CheckpointWriteError` of a pending async save that has failed (the loop calls it after
        every step, so a failure stops the run at the next step, not one save later); nothing otherwise."""
        pending = self._pending
        if pending is not None and not pending.thread.is_alive() and pending.error is not None:
            self.wait()

    def _write_and_commit(self, pending: _Pending, args: Any) -> None:
        """The thread of an async save: write the step, then commit it at once (so a run killed before its next
        save keeps it)."""
        try:
            self._manager.save(pending.step, args=args, force=True)
            self._commit(pending.step)
        except BaseException as error:  # reported by wait()
            pending.error = error

    def _write_error(self, step: int, size: int, error: BaseException) -> CheckpointWriteError:
        self._failed = True
        free = shutil.disk_usage(self.directory).free if self.directory.exists() else 0
        cause = getattr(error, "strerror", None) or str(error).splitlines()[0] or type(error).__name__
        return CheckpointWriteError(f"saving checkpoint {step} to {str(self.path(step))!r} failed: {cause} (it "
                                    f"needs about {size:,} bytes; {free:,} free); earlier checkpoints are intact")

    def _commit(self, step: int) -> None:
        """Flush checkpoint ``step`` to disk, mark it committed (flushed too), then apply retention."""
        folder = self.path(step)
        sharded = self._mesh is not None and dist.is_initialized()
        if sharded or _primary():  # each rank flushes what it wrote (its host's view of a shared folder)
            _fsync_tree(folder)
        if sharded:
            dist.barrier(group=self._barriers)
        if _primary():
            marker = folder / COMMIT_FILE
            with open(marker, "w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(folder)
            _fsync_dir(self.directory)
        if sharded:
            dist.barrier(group=self._barriers)

    def _apply_retention(self) -> None:
        """Delete the committed checkpoints the config does not keep: all but the newest ``keep_latest``, except
        multiples of ``keep_every`` (on rank 0, after the newest is committed)."""
        if self.config is None or self.config.keep_latest is None or not _primary():
            return
        steps = self.steps()
        for step in steps[:-self.config.keep_latest]:
            if self.config.keep_every is None or step % self.config.keep_every:
                shutil.rmtree(self.path(step), ignore_errors=True)
        self._manager.reload()

    # -------------------------------------------------------------------------------------------------- listing

    def steps(self) -> list[int]:
        """The steps of complete checkpoints, ascending (temporary folders of unfinished saves are not listed)."""
        if self._manager is None:
            return []
        if self._pending is None:  # else the commit thread uses the manager; the folders say what is committed
            self._manager.reload()
        return sorted(int(p.name) for p in self.directory.iterdir()
                      if p.name.isdigit() and (p / COMMIT_FILE).is_file()) if self.directory.is_dir() else []

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def _legacy(self, step: int) -> bool:
        """Whether checkpoint ``step`` is of the single-process format before fvx 0.2 (tensorstore, read only)."""
        return (self.path(step) / legacy.STATE_ITEM).is_dir()

    def is_sharded(self, step: int) -> bool:
        """Whether checkpoint ``step`` was saved by several processes (its state in more than one rank's file)."""
        return not self._legacy(step) and not (self.path(step) / SHARDS_ITEM / shard_files.file_name(0, 1)).is_file()

    def _require(self, step: int) -> pathlib.Path:
        steps = self.steps()
        if step not in steps:
            found = ", ".join(map(str, steps)) if steps else "none"
            raise CheckpointError(f"no checkpoint of step {step} in {str(self.directory)!r} (complete checkpoints: "
                                  f"{found})")
        path = self.path(step)
        for item in _JSON_ITEMS:  # orbax would raise a bare JSONDecodeError naming no file
            _check_json(path / item / "metadata")
        if (path / LEGACY_DCP_ITEM).is_dir():
            raise CheckpointError(f"checkpoint {str(path)!r} was saved by an earlier fvx with "
                                  "torch.distributed.checkpoint, whose metadata is pickled: fvx does not read it")
        if self._legacy(step):
            _check_json(path / legacy.CHECKSUMS_ITEM / "metadata")
            _check_json(path / legacy.STATE_ITEM / "_METADATA")
        else:
            self._shard_index(step)
        for item in _JSON_ITEMS:  # their CRCs, saved in the state's header
            self._record(step, item)
        return path

    # ---------------------------------------------------------------------------------------------------- saving

    def save(self, state: Any, *, config: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
        """Save ``state`` as checkpoint ``int(state.step)`` with the config record and metadata beside it; False if
        that step is already saved. Async: returns once this rank's host copy is taken; the caller may then update
        ``state`` in place."""
        if self.config is None:
            raise CheckpointError(f"{str(self.directory)!r} was opened for reading; pass a CheckpointConfig to save")
        self.wait()  # the previous save, committed (or its failure raised) first
        step = int(state.step)
        if step in self.steps():
            return False
        size = sum(t.numel() * t.element_size() for t in tree.tensor_leaves(state))
        index, count = (0, 1) if self._mesh is None else (self._mesh.get_local_rank(processes.SHARD),
                                                           self._mesh.size(1))
        pieces = shard_files.local_pieces(state, self._mesh, copy=self.config.async_save)
        args = _orbax().save_args(pieces, index, count, config, {**meta, "step": step})
        if self.config.async_save:
            self._pending = _Pending(step, size)
            self._pending.thread = threading.Thread(target=self._write_and_commit, args=(self._pending, args),
                                                    name=f"fvx-save-{step}", daemon=True)
            self._pending.thread.start()
            return True
        try:
            self._manager.save(step, args=args, force=True)
            self._commit(step)
        except Exception as error:
            raise self._write_error(step, size, error) from None
        self._apply_retention()
        return True

    # -------------------------------------------------------------------------------------------------- reading

    def read_json(self, step: int, item: str) -> dict[str, Any]:
        """The ``config`` or ``meta`` record of checkpoint ``step``, checked against the CRC saved with the state
        (only that item and the state's headers are read)."""
        if step not in self.steps():
            self._require(step)  # the error listing the checkpoints there are
        return self._record(step, item)

    def _record(self, step: int, item: str) -> dict[str, Any]:
        """A JSON record of checkpoint ``step``, or a CheckpointError naming its file when it does not parse or fails
        its CRC (checkpoints of fvx 0.1 recorded none)."""
        path = self.path(step) / item / "metadata"
        _check_json(path)
        record = json.loads(path.read_text())
        if not self._legacy(step):
            try:
                expected = shard_files.record_checksums(self.path(step) / SHARDS_ITEM).get(item)
            except shard_files.CorruptShard as error:
                raise self._corrupt(step, error) from None
            if expected is not None and files.json_checksum(record) != expected:
                raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: it fails the checksum saved with "
                                      "the state")
        return record

    def _stored(self, step: int) -> dict[str, TensorSpec]:
        """Every stored tensor of checkpoint ``step`` by stored name (path joined with ``/``): shape and dtype."""
        if self._legacy(step):
            return {shard_files.SEPARATOR.join(path): TensorSpec(tuple(m.shape), np.dtype(m.dtype))
                    for path, m in tree.named_leaves(self.layout(step))}
        return {name: _spec_of(pieces[0]) for name, pieces in self._shard_index(step).items()}

    def specs(self, step: int) -> dict[str, TensorSpec]:
        """Every stored tensor of checkpoint ``step`` by dotted name, with its shape and dtype (no tensor is read)."""
        return {_dotted(name): spec for name, spec in self._stored(step).items()}

    def _shard_index(self, step: int) -> dict[str, list[shard_files.Piece]]:
        """Every stored piece of checkpoint ``step`` by tensor name (read from the files' JSON headers)."""
        try:
            return shard_files.index(self.path(step) / SHARDS_ITEM)
        except shard_files.CorruptShard as error:
            raise self._corrupt(step, error) from None

    def _corrupt(self, step: int, error: Exception) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(self.path(step))!r} is corrupt or truncated: {error}")

    def layout(self, step: int) -> Any:
        """The stored tree of checkpoint ``step``: nested dicts (sequence indices as string keys, no None holes) with
        :class:`TensorSpec` leaves; for the format before fvx 0.2, nested dicts and lists (NamedTuples become dicts
        by field name, None stays None) with orbax ``ArrayMetadata`` leaves."""
        path = self._require(step)
        if self._legacy(step):
            try:
                return _orbax().legacy_layout(self._manager, step)
            except Exception as error:
                raise _unreadable(path, error) from None
        nested: dict = {}
        for name, pieces in self._shard_index(step).items():
            *parents, leaf = name.split(shard_files.SEPARATOR)
            node = nested
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = _spec_of(pieces[0])
        return nested

    def restore(self, step: int, target: Any) -> Any:
        """Checkpoint ``step`` restored into the structure of ``target`` (a state like the one saved: same names,
        shapes and dtypes, else one CheckpointError lists every difference); tensors land on ``target``'s devices,
        as this rank's local shards on a mesh."""
        path = self._require(step)
        view = target if self._mesh is None else sharding.checkpoint_tree(target, self._mesh)
        matched = match_names(self._stored(step), _specs(view), f"checkpoint {str(path)!r}")
        if self._legacy(step):
            whole = self._read_legacy(step, None)
            region = lambda name, dim, start, stop: _narrow(whole[matched[name]], dim, start, stop)  # noqa: E731
        else:
            pieces = self._shard_index(step)
            region = lambda name, dim, start, stop: shard_files.read_region(  # noqa: E731
                pieces[matched[name]], dim, start, stop)
        state, message = None, None
        try:
            state = shard_files.read_into(region, target, self._mesh)
        except shard_files.CorruptShard as error:
            message = str(self._corrupt(step, error))
        if self._mesh is not None:  # the ranks agree: if any rank's pieces fail their checks, every rank raises
            message = processes.first_error(message)
        if message is not None:
            raise CheckpointError(message)
        return state

    def read(self, step: int, path: tuple[str, ...]) -> Any:
        """The subtree at ``path`` (e.g. ``("roles", "student", "params")``) of checkpoint ``step``, as nested dicts
        of whole CPU tensors, read without building the rest of the state."""
        node = self.layout(step)
        for depth, key in enumerate(path):
            where = ".".join(path[:depth]) or "the state"
            if not isinstance(node, dict) or key not in node:
                have = ", ".join(map(str, node)) if isinstance(node, dict) else "nothing"
                raise CheckpointError(f"checkpoint {str(self.path(step))!r} has no {'.'.join(path[:depth + 1])!r} "
                                      f"({where} holds: {have})")
            node = node[key]
        if not leaves_by_name(node):
            raise CheckpointError(f"checkpoint {str(self.path(step))!r} holds no tensors under {'.'.join(path)!r}")
        if self._legacy(step):
            return self._read_legacy(step, path, node)
        prefix = shard_files.SEPARATOR.join(path) + shard_files.SEPARATOR if path else ""
        nested: dict = {}
        for name, pieces in self._shard_index(step).items():
            if not name.startswith(prefix):
                continue
            try:
                tensor = shard_files.read_region(pieces)
            except shard_files.CorruptShard as error:
                raise self._corrupt(step, error) from None
            *parents, leaf = name[len(prefix):].split(shard_files.SEPARATOR)
            node = nested
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = tensor
        return nested

    def _read_legacy(self, step: int, path: tuple[str, ...] | None, node: Any = None) -> Any:
        """A checkpoint of the format before fvx 0.2: the subtree ``node`` at ``path``, or (``path`` None) every
        tensor by stored name; each checked against its CRC."""
        where = self.path(step)
        item = tree.tree_map(lambda _: 0, self.layout(step) if path is None else node)
        for key in reversed(path or ()):
            item = {key: item}
        try:
            restored, sums = _orbax().legacy_read(self._manager, step, item, partial=path is not None)
        except Exception as error:
            raise _unreadable(where, error) from None
        try:
            legacy.verify(restored, sums, str(where))
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        if path is None:
            return {shard_files.SEPARATOR.join(p): t for p, t in tree.named_leaves(restored)}
        for key in path:
            restored = restored[key]
        return restored


def _narrow(tensor: torch.Tensor, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
    return tensor if dim is None else tensor.narrow(dim, start, (tensor.shape[dim] if stop is None else stop) - start)


@dataclasses.dataclass
class _Pending:
    """An async save in flight: its step and bytes, the thread that writes and commits it, and its error, if any."""

    step: int
    size: int
    thread: threading.Thread | None = None
    error: BaseException | None = None


def _fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: pathlib.Path) -> None:
    """``fsync`` every file below ``folder``, then every folder (their entries), deepest first."""
    for root, _, names in os.walk(folder, topdown=False):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(pathlib.Path(root))


def _primary() -> bool:
    """Whether this process is rank 0 (or the only one)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _spec_of(piece: shard_files.Piece) -> TensorSpec:
    """The :class:`TensorSpec` of a stored piece's tensor."""
    return TensorSpec(piece.shape, _dtype(shard_files.DTYPES[piece.dtype]))


def _quiet_late_reads() -> None:
    """After a failed read, tensorstore still completes the other reads and calls back into orbax's event loop, which
    is closed by then: have ``sys.unraisablehook`` drop those ``RuntimeError('Event loop is closed')`` reports (and
    only those) instead of printing a traceback for each."""
    previous = sys.unraisablehook

    def hook(report) -> None:
        if not (report.exc_type is RuntimeError and str(report.exc_value) == "Event loop is closed"):
            previous(report)

    sys.unraisablehook = hook


def _check_json(path: pathlib.Path) -> None:
    try:
        json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt or truncated ({error})") from None


def _unreadable(path: pathlib.Path, error: Exception) -> CheckpointError:
    """A CheckpointError for an orbax/tensorstore failure, naming the file the error names (tensorstore's last
    ``local file "..."``) or else the checkpoint folder."""
    message = str(error)
    files = re.findall(r'local file \\?"([^"\\]+)\\?"', message)
    culprit = files[-1] if files else str(path)
    reason = message.split(" [tensorstore_spec=")[0].strip() or type(error).__name__
    return CheckpointError(f"checkpoint {str(path)!r} is corrupt or truncated: cannot read {culprit!r} ({reason})")
