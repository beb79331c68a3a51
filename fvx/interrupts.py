"""Stopping a run on SIGTERM or SIGINT without losing work: a signal only sets a flag; the loop finishes the step in
flight, saves a checkpoint of it and stops (:class:`Interrupted`). A second signal exits at once. On a multi-process
run every rank learns of a stop from the others (``fvx.sharding.any_rank``), so all save the same step.
"""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType


class Interrupted(Exception):
    """The run stopped on a signal after saving the state of ``step`` (the steps taken)."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}")
        self.step, self.signum = step, signum


class Signals:
    """Within ``with Signals() as signals:`` SIGTERM and SIGINT set ``signals.received`` (the first one's number) and
    a second one ends the process at once (exit status 128 + its number). Outside the main thread it does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
