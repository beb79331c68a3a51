"""The progress of a long command (a cache build, preprocessing): a bar on a terminal, a line about every 30 s when the
output goes to a log."""
from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int, *, desc: str, unit: str, show: bool, bar_format: str | None = None) -> tqdm:
    """A tqdm of ``total`` ``unit``s: done, rate and time left; nothing when not ``show``."""
    shown = dict(total=total, desc=desc, unit=unit, **({"bar_format": bar_format} if bar_format else {}))
    if not show or sys.stderr.isatty():
        return tqdm(**shown, dynamic_ncols=True, disable=not show)
    return tqdm(**shown, mininterval=30, ncols=100, ascii=True, file=sys.stdout)
