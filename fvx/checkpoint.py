"""Checkpoints of the training state, on orbax-checkpoint's ``CheckpointManager``.

A checkpoint is a folder ``<directory>/<step>/``, ``step`` being the number of steps taken (the state's ``step``: the
state a run resumed from it continues with step ``step``). It holds four orbax items:

    state/      the state pytree as it is; tensors in tensorstore (OCDBT), through :class:`TensorHandler`
    checksums/  CRC-32 of every tensor's bytes, computed from what was written (JSON)
    config/     the resolved config (JSON, as ``fvx.config.dump`` writes it)
    meta/       run metadata: fvx, torch and diffusers versions, step, world size, how the run was started (JSON)

Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it once every item is complete, so a save killed
half-way leaves a temporary folder that listing and restoring never see; a writing :class:`Checkpoints` deletes such
folders when it opens (before any save, so that step can be saved again). A step then counts only once fvx has
*committed* it: every file and folder of it flushed to disk (``fsync``), then the marker file ``fvx-committed``
written and flushed, so a committed checkpoint survives power loss (orbax itself flushes nothing). Retention (keep the
newest K, and every M-th for good) is fvx's, applied only after a newer checkpoint is committed. A save that fails
(no space left, any I/O error) raises a :class:`CheckpointWriteError` naming the folder and the bytes it needed;
the uncommitted folder it leaves is never listed and is cleared by the next writer. Loading reads JSON and raw array
bytes only; nothing is unpickled. Restoring checks the stored tree against a target state (names, shapes, dtypes; every
difference listed) and every tensor against its checksum (OCDBT checksums its b-tree, not the array bytes: a flipped
byte in a tensor would otherwise restore silently).

Async saves and donation. The training step updates the state's tensors in place, so an async save must not write
from them: :meth:`Checkpoints.save` first copies the state to host memory (a CPU clone, or the device-to-host copy a
GPU state needs anyway) and orbax writes the copy in the background while training goes on. Waiting for the save
before the next step instead would overlap nothing, since that step updates the state at once. Measured on 2 CPU
cores: a 1.2 GB state blocks training for 0.19 s (0.10 s of it the copy) of a 1.4 s save. A synchronous save writes
straight from the state's own memory (zero-copy numpy views) and returns once the step folder is complete.

Sharded state (a multi-process run: ``Checkpoints(..., mesh=)``, the state holding ``fvx.sharding.Shards``, each
with its own layout) goes to a fifth item ``shards/`` instead of ``state/`` and ``checksums/``: one safetensors file
per rank of its unpadded slices, JSON metadata and a CRC-32 per slice (``fvx.shard_files``; nothing pickled, unlike
``torch.distributed.checkpoint``'s ``.metadata``). Any region of any tensor reads back from the slices that overlap it,
so a checkpoint saved on N processes restores on M: into local shards on a mesh, or into full tensors in one process
(resume, replay, export), and every slice read is checked. A single-process checkpoint also restores on a mesh (each
rank reads it whole and keeps its slice). All processes call every method of a sharded :class:`Checkpoints` in the
same order (orbax barriers through ``jax.distributed``, which must be initialised:
``fvx.sharding.init_jax_distributed``). An async sharded save takes each rank's host slices, then writes, flushes
and commits them on a thread whose barriers use a process group of their own (never the one the training step's
collectives use), so ranks agree without the training loop waiting.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import threading
import zlib
from typing import Annotated, Any, Mapping, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # orbax imports jax: keep it off the GPUs torch uses

import ml_dtypes  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from orbax.checkpoint import type_handlers  # noqa: E402

from fvx import shard_files, sharding, tree  # noqa: E402
from fvx.config import Config  # noqa: E402

TMP_SUFFIX = ".orbax-checkpoint-tmp"
_LIST_LIMIT = 10  # names shown per category in an error message
_JSON_ITEMS = ("config", "meta")
SHARDS_ITEM = "shards"  # the item holding sharded state
LEGACY_DCP_ITEM = "dcp"  # sharded state of earlier fvx versions: pickled metadata, never read


class CheckpointConfig(Config):
    """When a run saves its state and which checkpoints it keeps.

    every: save after every ``every``-th step (0: no periodic saves); every_seconds: also save after the first step
    that ends that long after the last save (None: no timed saves). final: also save after the last step (once,
    even when it is a multiple of ``every``). keep_latest: keep the newest K checkpoints (None: keep all).
    keep_every: also keep, for good, each checkpoint whose step is a multiple of M (orbax's ``keep_period``).
    async_save: write in the background from a host copy of the state, while training goes on.
    """

    every: Annotated[int, msgspec.Meta(ge=0)] = 100
    every_seconds: Annotated[float, msgspec.Meta(gt=0)] | None = None
    final: bool = True
    keep_latest: Annotated[int, msgspec.Meta(ge=1)] | None = 3
    keep_every: Annotated[int, msgspec.Meta(ge=1)] | None = None
    async_save: bool = True


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


def due(config: CheckpointConfig, step: int, last_step: int) -> bool:
    """Whether a run saves after taking ``step`` steps (of ``last_step``): each multiple of ``every``, and the last."""
    return bool((config.every and step % config.every == 0) or (config.final and step == last_step))


# ------------------------------------------------------------------------------------------------ torch <-> numpy


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (zero-copy; bf16 as ``ml_dtypes.bfloat16``); other devices are copied to host."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (``ml_dtypes.bfloat16`` becomes torch.bfloat16)."""
    array = np.asarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in host memory, which later in-place updates of ``tensor`` do not touch."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes in C order (zlib's, about 2 GB/s; releases the GIL)."""
    return zlib.crc32(np.ascontiguousarray(as_numpy(tensor)).reshape(-1).view(np.uint8))


class TensorHandler(type_handlers.NumpyHandler):
    """Orbax storage of ``torch.Tensor`` leaves: written as numpy arrays (views, no copy), read back as CPU tensors.

    Orbax's own host copy (``deepcopy_host_arrays``) is off: a synchronous save needs none, and an async save copies
    the whole state itself first (:meth:`Checkpoints.save`), which also covers the checksums.
    """

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    def typestr(self) -> str:
        return "torch.Tensor"

    async def serialize(self, values, infos, args=None):
        return await super().serialize([as_numpy(v) for v in values], infos, args)

    async def deserialize(self, infos, args=None):
        return [from_numpy(a) for a in await super().deserialize(infos, args)]


class ChecksumHandler(ocp.JsonCheckpointHandler):
    """Writes the CRC-32 of every tensor of a flat ``{name: tensor}`` as JSON, computed in the save's background."""

    async def _save_fn(self, tensors, directory):
        sums = await asyncio.to_thread(lambda: {name: checksum(t) for name, t in tensors.items()})
        await super()._save_fn(sums, directory)


@ocp.args.register_with_handler(ChecksumHandler, for_save=True)
@dataclasses.dataclass
class ChecksumSave(ocp.args.CheckpointArgs):
    item: Mapping[str, torch.Tensor]


@ocp.args.register_with_handler(ChecksumHandler, for_restore=True)
@dataclasses.dataclass
class ChecksumRestore(ocp.args.CheckpointArgs):
    pass


class ShardsHandler(ocp.CheckpointHandler):
    """Orbax item of sharded state: each process writes its own safetensors file (``fvx.shard_files``); reading
    goes through :mod:`fvx.shard_files` directly."""

    def save(self, directory, args: ShardsSave) -> None:
        shard_files.write(pathlib.Path(directory), args.pieces, args.index, args.count)

    def restore(self, directory, args: Any = None) -> None:
        raise NotImplementedError("sharded state is read with fvx.shard_files")

    def metadata(self, directory) -> None:
        return None

    def finalize(self, directory) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(ShardsHandler, for_save=True)
@dataclasses.dataclass
class ShardsSave(ocp.args.CheckpointArgs):
    pieces: Mapping[str, Any]  # name -> (host slice, its record)
    index: int
    count: int


@ocp.args.register_with_handler(ShardsHandler, for_restore=True)
@dataclasses.dataclass
class ShardsRestore(ocp.args.CheckpointArgs):
    """Unused (sharded state is read with fvx.shard_files); orbax needs restore args registered per handler."""


class _QuietOrbax(logging.Filter):
    """Drops orbax warnings about choices fvx makes on purpose: a registry without jax.Array (fvx keeps no array
    metadata) and read-only managers."""

    BENIGN = ("No jax.Array in TypeHandlerRegistry", "read_only=True, setting save_interval_steps",
              "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.BENIGN)


logging.getLogger("absl").addFilter(_QuietOrbax())


# ---------------------------------------------------------------------------------------------------- tree names


def leaves_by_path(state: Any) -> dict[tuple[str, ...], Any]:
    """The leaves of a pytree by path of key names (``("roles", "student", "opt_state", "1", "mu", <param>)``)."""
    return dict(tree.named_leaves(state))


def leaves_by_name(state: Any) -> dict[str, Any]:
    """The leaves of a pytree by dotted path, as orbax names them (``roles.student.opt_state.mu.<param>``)."""
    by_path = leaves_by_path(state)
    named = {".".join(path): leaf for path, leaf in by_path.items()}
    if len(named) != len(by_path):
        raise ValueError("checkpoint: two leaves of the state have the same dotted name (keys containing dots?)")
    return named


def _specs(state: Any) -> dict[str, TensorSpec]:
    """Dotted name -> shape and dtype of every leaf (a DTensor's are its global ones)."""
    specs = {}
    for name, leaf in leaves_by_name(state).items():
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"checkpoint: the state must hold tensors only; {name!r} is a {type(leaf).__name__}")
        specs[name] = TensorSpec(tuple(leaf.shape), as_numpy(torch.empty(0, dtype=leaf.dtype)).dtype)
    return specs


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


def check_fits(stored: Mapping[str, TensorSpec], target: Mapping[str, TensorSpec], where: str) -> None:
    """A CheckpointError listing missing and unexpected tensors and shape or dtype mismatches, stored vs target."""
    missing = [name for name in target if name not in stored]
    unexpected = [name for name in stored if name not in target]
    mismatched = [f"{name}: checkpoint {list(stored[name].shape)} {stored[name].dtype}, run {list(spec.shape)} "
                  f"{spec.dtype}" for name, spec in target.items() if name in stored and stored[name] != spec]
    problems = [f"{label} ({len(items)}): {_listed(items)}"
                for label, items in (("missing in the checkpoint", missing), ("not in this run's state", unexpected),
                                     ("shape or dtype mismatches", mismatched)) if items]
    if problems:
        raise CheckpointMismatch(f"{where} does not fit this run's state: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------------------ the manager


class Checkpoints:
    """The checkpoints in one folder. ``Checkpoints(directory, config)`` saves (and deletes what retention drops);
    ``Checkpoints(directory)`` only reads. Use as a context manager, or call :meth:`close` (it waits for saves).

    With ``mesh`` (``fvx.sharding.make_mesh``) the states saved and restored hold this rank's ``Shards``, and every
    process of the mesh makes the same calls (module docstring)."""

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig | None = None, *, mesh: Any = None):
        self.directory = pathlib.Path(directory).absolute()
        self.config = config
        self._mesh = mesh
        self._manager = None
        self._failed = False  # a save failed (reported once)
        self._pending: _Pending | None = None  # an async save, committed by its own thread once written
        # the commit's barriers: a group of their own, as an async save's thread runs them beside the step's collectives
        self._barriers = dist.new_group(backend="gloo") if config is not None and mesh is not None else None
        _quiet_late_reads()
        if config is None and not self.directory.is_dir():
            return  # nothing to read: steps() is empty
        if config is not None and self.directory.is_dir() and _primary():
            for unfinished in self.directory.glob(f"*{TMP_SUFFIX}*"):
                shutil.rmtree(unfinished, ignore_errors=True)
            for step_dir in self.directory.iterdir():  # complete in orbax's eyes, never committed: not a checkpoint
                if step_dir.name.isdigit() and not (step_dir / COMMIT_FILE).is_file():
                    shutil.rmtree(step_dir, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(
            read_only=config is None,
            create=config is not None,
            enable_async_checkpointing=config is not None and config.async_save and mesh is None,
        )
        registry = type_handlers.create_type_handler_registry((torch.Tensor, TensorHandler()))
        handlers = {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
                    "checksums": ChecksumHandler(), "config": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(), SHARDS_ITEM: ShardsHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

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

    def _commit_when_written(self, pending: _Pending, sharded_args: Any = None) -> None:
        """The commit thread of an async save: commit as soon as orbax has written the step (so a run killed before
        its next save keeps it); a sharded save (``sharded_args``) is written by this thread too."""
        try:
            if sharded_args is not None:
                self._manager.save(pending.step, args=sharded_args, force=True)
            self._manager.wait_until_finished()
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

    def is_sharded(self, step: int) -> bool:
        """Whether checkpoint ``step`` holds sharded state (a multi-process save)."""
        return (self.path(step) / SHARDS_ITEM).is_dir()

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
        if self.is_sharded(step):
            self._shard_index(step)
        else:
            _check_json(path / "checksums" / "metadata")
            _check_json(path / "state" / "_METADATA")
        return path

    # ---------------------------------------------------------------------------------------------------- saving

    def save(self, state: Any, *, config: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
        """Save ``state`` as checkpoint ``int(state.step)`` with the config record and metadata beside it; False if
        that step is already saved. Async: returns once a host copy is taken; the caller may then update ``state``
        in place."""
        if self.config is None:
            raise CheckpointError(f"{str(self.directory)!r} was opened for reading; pass a CheckpointConfig to save")
        self.wait()  # the previous save, committed (or its failure raised) first
        step = int(state.step)
        if step in self.steps():
            return False
        size = sum(t.numel() * t.element_size() for t in tree.tensor_leaves(state))
        if self._mesh is not None:  # every rank writes its own file (host slices), then orbax's barrier
            _specs(sharding.checkpoint_tree(state, self._mesh))  # tensors only, or a TypeError naming the leaf
            items = {SHARDS_ITEM: ShardsSave(shard_files.local_pieces(state, self._mesh),
                                             self._mesh.get_local_rank(sharding.SHARD), self._mesh.size(1))}
        else:
            tensors = tree.map_tensors(host_copy, state) if self.config.async_save else state
            named = leaves_by_name(tensors)
            _specs(tensors)  # tensors only, or a TypeError naming the leaf
            items = {"state": ocp.args.PyTreeSave(tensors), "checksums": ChecksumSave(named)}
        args = ocp.args.Composite(**items, config=ocp.args.JsonSave(dict(config)),
                                  meta=ocp.args.JsonSave({**meta, "step": step}))
        sharded_async = self.config.async_save and self._mesh is not None
        if not sharded_async:
            try:
                if not self._manager.save(step, args=args, force=True):
                    return False
            except Exception as error:
                raise self._write_error(step, size, error) from None
        if self.config.async_save:
            self._pending = _Pending(step, size)
            self._pending.thread = threading.Thread(target=self._commit_when_written,
                                                    args=(self._pending, args if sharded_async else None),
                                                    name=f"fvx-commit-{step}", daemon=True)
            self._pending.thread.start()
        else:
            try:
                self._commit(step)
            except OSError as error:
                raise self._write_error(step, size, error) from None
            self._apply_retention()
        return True

    # -------------------------------------------------------------------------------------------------- reading

    def read_json(self, step: int, item: str) -> dict[str, Any]:
        """The ``config`` or ``meta`` record of checkpoint ``step`` (only that item is checked)."""
        if step not in self.steps():
            self._require(step)  # the error listing the checkpoints there are
        path = self.path(step) / item / "metadata"
        _check_json(path)
        return json.loads(path.read_text())

    def specs(self, step: int) -> dict[str, TensorSpec]:
        """Every stored tensor of checkpoint ``step`` by dotted name, with its shape and dtype (no array is read)."""
        if self.is_sharded(step):
            return {name.replace(shard_files.SEPARATOR, "."): _spec_of(pieces[0])
                    for name, pieces in self._shard_index(step).items()}
        return {name: TensorSpec(tuple(m.shape), np.dtype(m.dtype))
                for name, m in leaves_by_name(self.layout(step)).items()}

    def _shard_index(self, step: int) -> dict[str, list[shard_files.Piece]]:
        """Every stored slice of sharded checkpoint ``step`` by tensor name (read from the files' JSON headers)."""
        try:
            return shard_files.index(self.path(step) / SHARDS_ITEM)
        except shard_files.CorruptShard as error:
            raise CheckpointError(str(error)) from None

    def layout(self, step: int) -> Any:
        """The stored tree of checkpoint ``step``: nested dicts and lists (NamedTuples become dicts by field name,
        None stays None) with orbax ``ArrayMetadata`` leaves; for a sharded checkpoint, nested dicts (sequence
        indices as string keys, no None holes) with :class:`TensorSpec` leaves."""
        path = self._require(step)
        if self.is_sharded(step):
            nested: dict = {}
            for name, pieces in self._shard_index(step).items():
                *parents, leaf = name.split(shard_files.SEPARATOR)
                node = nested
                for key in parents:
                    node = node.setdefault(key, {})
                node[leaf] = _spec_of(pieces[0])
            return nested
        try:
            return self._manager.item_metadata(step)["state"].tree
        except Exception as error:
            raise _unreadable(path, error) from None

    def restore(self, step: int, target: Any) -> Any:
        """Checkpoint ``step`` restored into the structure of ``target`` (a state like the one saved: same names,
        shapes and dtypes, else one CheckpointError lists every difference); tensors land on ``target``'s devices."""
        path = self._require(step)
        where = f"checkpoint {str(path)!r}"
        if self._mesh is not None:
            return self._restore_sharded(step, target, where)
        if self.is_sharded(step):  # saved by N processes, restored whole in this one
            check_fits(self.specs(step), _specs(target), where)
            return self._read_shards(step, target, None)
        check_fits(self.specs(step), _specs(target), where)
        restored = self._read(step, target, partial=False)
        return tree.map_tensors(lambda r, t: torch.empty_like(t).copy_(r), restored, target)

    def _restore_sharded(self, step: int, target: Any, where: str) -> Any:
        """Checkpoint ``step`` as this rank's local shards, ``target`` giving the structure: the slices of a sharded
        checkpoint that overlap this rank's (zero padding kept); a single-process one is read whole and sliced."""
        mesh = self._mesh
        if self.is_sharded(step):
            check_fits(self.specs(step), _specs(sharding.checkpoint_tree(target, mesh)), where)
            return self._read_shards(step, target, mesh)
        check_fits(self.specs(step), _specs(sharding.checkpoint_tree(target, mesh)), where)
        full = self._read(step, _plain(target, mesh), partial=False)
        return sharding.local_slices(full, target, mesh)

    def _read_shards(self, step: int, target: Any, mesh: Any) -> Any:
        """Sharded checkpoint ``step`` read into ``target``'s structure (this rank's slices on ``mesh``). On a mesh
        the ranks agree: if any rank's slices fail their checks, every rank raises that rank's error."""
        state, message = None, None
        try:
            state = shard_files.read_into(self._shard_index(step), target, mesh)
        except (shard_files.CorruptShard, CheckpointError) as error:
            message = str(error)
        if mesh is not None:
            message = sharding.first_error(message)
        if message is not None:
            raise CheckpointError(message)
        return state

    def read(self, step: int, path: tuple[str, ...]) -> Any:
        """The subtree at ``path`` (e.g. ``("roles", "student", "params")``) of checkpoint ``step``, as CPU tensors,
        read without building the rest of the state."""
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
        if self.is_sharded(step):
            return self._read_sharded(step, tuple(path))
        item = tree.tree_map(lambda _: 0, node)
        for key in reversed(path):
            item = {key: item}
        restored = self._read(step, item, partial=True)
        for key in path:
            restored = restored[key]
        return restored

    def _read_sharded(self, step: int, path: tuple[str, ...]) -> dict:
        """The subtree at ``path`` of sharded checkpoint ``step``, whole in this process (nested dicts of CPU
        tensors)."""
        prefix = shard_files.SEPARATOR.join(path) + shard_files.SEPARATOR
        nested: dict = {}
        for name, pieces in self._shard_index(step).items():
            if not name.startswith(prefix):
                continue
            try:
                tensor = shard_files.read_region(pieces, name)
            except shard_files.CorruptShard as error:
                raise CheckpointError(str(error)) from None
            *parents, leaf = name[len(prefix):].split(shard_files.SEPARATOR)
            node = nested
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = tensor
        return nested

    def _read(self, step: int, item: Any, *, partial: bool) -> Any:
        """Read the tensors of ``item``'s structure and check them against the stored checksums."""
        path = self.path(step)
        restore_args = tree.tree_map(lambda _: ocp.RestoreArgs(restore_type=torch.Tensor), item)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                               partial_restore=partial),
                                  checksums=ChecksumRestore())
        try:
            result = self._manager.restore(step, args=args)
        except Exception as error:
            raise _unreadable(path, error) from None
        _verify(result["state"], result["checksums"], path)
        return result["state"]


@dataclasses.dataclass
class _Pending:
    """An async save in flight: its step and bytes, the thread that commits it, and its error, if any."""

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
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
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
    """The :class:`TensorSpec` of a stored slice's tensor."""
    return TensorSpec(piece.shape, as_numpy(torch.empty(0, dtype=shard_files.DTYPES[piece.dtype])).dtype)


def _plain(target: Any, mesh: Any) -> Any:
    """``target`` with each ``Shards`` as a plain dict of zeros of its full unpadded shapes: the structure a
    single-process checkpoint is read into before it is sliced."""
    def full(node: Any) -> Any:
        if isinstance(node, sharding.Shards):
            return {name: None if t is None else torch.zeros(node.layout[name].shape, dtype=t.dtype)
                    for name, t in node.items()}
        return node

    return tree.tree_map(full, target, is_leaf=lambda n: isinstance(n, sharding.Shards), none_is_leaf=True)


def _verify(state: Any, sums: Mapping[str, int], path: pathlib.Path) -> None:
    for name, tensor in leaves_by_name(state).items():
        if name not in sums:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {str(path / 'checksums')!r} has no checksum "
                                  f"for {name!r}")
        if checksum(tensor) != sums[name]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: the bytes of {name!r} in "
                                  f"{str(path / 'state')!r} do not match the checksum written with them")


def _quiet_late_reads() -> None:
    """After a failed read, tensorstore still completes the other reads and calls back into orbax's event loop, which
    is closed by then: have ``sys.unraisablehook`` drop those ``RuntimeError('Event loop is closed')`` reports (and
    only those) instead of printing a traceback for each. Installed once, by the first :class:`Checkpoints`."""
    previous = sys.unraisablehook
    if getattr(previous, "_fvx_quiet", False):
        return

    def hook(report) -> None:
        if not (report.exc_type is RuntimeError and str(report.exc_value) == "Event loop is closed"):
            previous(report)

    hook._fvx_quiet = True
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
