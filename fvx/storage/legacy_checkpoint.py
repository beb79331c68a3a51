"""Reading checkpoints that earlier fvx versions wrote (never writing them): what changed, and how it reads today.

- Single-process state in fvx 0.1 was orbax items ``state/`` (the tensors in tensorstore) and ``checksums/`` (a CRC-32
  per tensor, JSON). ``fvx.storage.orbax_items`` reads them back; :func:`verify` checks every tensor against its CRC.
  Nothing is unpickled.
- AdamW's state in fvx 0.1 was one ``AdamWState(count, mu, nu)``; since, ``adamw`` is the chain ``(scale_by_adam,
  add_decayed_weights, scale_by_learning_rate)`` with state ``(ScaleByAdamState(count, mu, nu), EmptyState(),
  ScaleByScheduleState(count))``. :func:`stored_name` maps each name of the new layout to the name an earlier
  checkpoint stored it under (both counts come from the one count), in either format.
"""
from __future__ import annotations

import re
from typing import Any, Collection, Mapping

from fvx.core import tree
from fvx.storage import shard_files

STATE_ITEM, CHECKSUMS_ITEM = "state", "checksums"  # the items of a single-process checkpoint of fvx 0.1

_CHAIN = (r"(?P<head>(?:.*{sep})?opt_state){sep}(?:0{sep}(?P<adam>count|mu|nu)|2{sep}(?P<schedule>count))"
          r"(?P<tail>{sep}.*)?$")


def stored_name(name: str, stored: Collection[str], separator: str = ".") -> str | None:
    """The name under which a checkpoint holds the tensor the current state calls ``name``: ``name`` itself, or,
    for AdamW's chain state, its name in the ``AdamWState`` of earlier versions; None when it holds neither."""
    if name in stored:
        return name
    match = re.match(_CHAIN.format(sep=re.escape(separator)), name)
    if match is None:
        return None
    old = f"{match['head']}{separator}{match['adam'] or match['schedule']}{match['tail'] or ''}"
    return old if old in stored else None


def verify(state: Any, sums: Mapping[str, int], where: str) -> None:
    """A ValueError naming the first tensor of ``state`` (as read from checkpoint ``where``) whose bytes do not match
    the CRC-32 written with them."""
    for path, tensor in tree.named_leaves(state):
        name = ".".join(path)
        if name not in sums:
            raise ValueError(f"checkpoint {where!r} is corrupt: {where}/{CHECKSUMS_ITEM} has no checksum for {name!r}")
        if shard_files.checksum(tensor) != sums[name]:
            raise ValueError(f"checkpoint {where!r} is corrupt: the bytes of {name!r} in '{where}/{STATE_ITEM}' do not "
                             "match the checksum written with them")
