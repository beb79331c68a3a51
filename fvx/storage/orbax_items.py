"""The orbax side of fvx's checkpoint manager (``fvx.storage.checkpoint``): the item handlers a
``CheckpointManager`` writes and reads a step folder with. The one module of fvx that imports orbax (and with it
JAX), imported when the first manager opens, never when fvx or an experiment is imported.

Items: ``shards`` (the state as ``fvx.storage.shard_files``; each process writes its own file, read with
``shard_files`` directly), ``config`` and ``meta`` (JSON), and, to read checkpoints of fvx 0.1, its ``state``
(tensorstore through :class:`TensorHandler`) and ``checksums`` (JSON).
"""
from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from typing import Any, Mapping

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import torch
from orbax.checkpoint import type_handlers

from fvx.core import tree
from fvx.storage import files, legacy_checkpoint as legacy, shard_files

SHARDS_ITEM = "shards"  # the item holding the state


class ShardsHandler(ocp.AsyncCheckpointHandler):
    """The ``shards`` item: this process's safetensors file (``fvx.storage.shard_files``), written beside the JSON
    items and awaited with them (so a failed write leaves none of theirs pending)."""

    async def async_save(self, directory, args: ShardsSave) -> None:
        await asyncio.to_thread(self.save, directory, args)

    def save(self, directory, args: ShardsSave) -> None:
        shard_files.write(pathlib.Path(directory), args.pieces, args.index, args.count, args.records)

    def restore(self, directory, args: Any = None) -> None:
        raise NotImplementedError("the state is read with fvx.storage.shard_files")

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
    records: Mapping[str, int]  # the CRC of each JSON record saved beside the state


@ocp.args.register_with_handler(ShardsHandler, for_restore=True)
@dataclasses.dataclass
class ShardsRestore(ocp.args.CheckpointArgs):
    """Unused (the state is read with fvx.storage.shard_files); orbax needs restore args registered per handler."""


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (``ml_dtypes.bfloat16`` becomes torch.bfloat16)."""
    array = np.asarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class TensorHandler(type_handlers.NumpyHandler):
    """fvx 0.1's ``state`` item: ``torch.Tensor`` leaves stored as numpy arrays, read back as CPU tensors."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    def typestr(self) -> str:
        return "torch.Tensor"

    async def deserialize(self, infos, args=None):
        return [from_numpy(a) for a in await super().deserialize(infos, args)]


def handlers() -> dict[str, ocp.CheckpointHandler]:
    """Every item's handler, by item name."""
    registry = type_handlers.create_type_handler_registry((torch.Tensor, TensorHandler()))
    return {SHARDS_ITEM: ShardsHandler(), "config": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
            legacy.STATE_ITEM: ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
            legacy.CHECKSUMS_ITEM: ocp.JsonCheckpointHandler()}


def manager(directory: pathlib.Path, *, read_only: bool) -> ocp.CheckpointManager:
    """orbax's manager of the step folders in ``directory``: synchronous (fvx's own thread makes saves async)."""
    options = ocp.CheckpointManagerOptions(read_only=read_only, create=not read_only,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers())


def save_args(pieces: Mapping[str, Any], index: int, count: int, config: Mapping[str, Any],
              meta: Mapping[str, Any]) -> ocp.args.Composite:
    """What a save writes: this rank's ``pieces`` of the state (rank ``index`` of ``count``), the config and the meta,
    their CRCs in the state's header (``fvx.storage.files.json_checksum``)."""
    records = {"config": files.json_checksum(config), "meta": files.json_checksum(meta)}
    return ocp.args.Composite(**{SHARDS_ITEM: ShardsSave(pieces, index, count, records)},
                              config=ocp.args.JsonSave(dict(config)), meta=ocp.args.JsonSave(dict(meta)))


def legacy_layout(manager_: ocp.CheckpointManager, step: int) -> Any:
    """fvx 0.1's stored tree: nested dicts and lists (NamedTuples as dicts by field name, None kept) with orbax
    ``ArrayMetadata`` leaves."""
    return manager_.item_metadata(step)[legacy.STATE_ITEM].tree


def legacy_read(manager_: ocp.CheckpointManager, step: int, item: Any, *, partial: bool) -> tuple[Any, dict]:
    """The tensors of ``item``'s structure (fvx 0.1's stored layout, or part of it with ``partial``) and the CRCs
    written with them."""
    restore_args = tree.tree_map(lambda _: ocp.RestoreArgs(restore_type=torch.Tensor), item)
    args = ocp.args.Composite(**{legacy.STATE_ITEM: ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                          partial_restore=partial),
                                 legacy.CHECKSUMS_ITEM: ocp.args.JsonRestore()})
    result = manager_.restore(step, args=args)
    return result[legacy.STATE_ITEM], result[legacy.CHECKSUMS_ITEM]
