"""Stopping a run on SIGTERM or SIGINT without losing work: a signal only sets a flag; the loop finishes the step in
flight, saves a checkpoint of it and stops (:class:`Interrupted`). A second signal exits at once. On a multi-process run
every rank learns of a stop from the others (``fvx.distributed.processes.any_rank``), so all save the same step. A
worker started by torchrun also stops (as on SIGTERM) when its launcher dies, instead of training on unsupervised.
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
    a second one ends the process at once (exit status 128 + its number). Outside the main thread it does nothing.
    Under torchrun (``TORCHELASTIC_RUN_ID`` set) a changed parent process (the launcher died) reads as SIGTERM."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._received: int | None = None
        self._previous: dict[int, object] = {}
        self._launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None

    @property
    def received(self) -> int | None:
        if self._received is None and self._launcher is not None and os.getppid() != self._launcher:
            self._received = signal.SIGTERM  # orphaned: the launcher that would forward signals is gone
        return self._received

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received is not None:
            os._exit(128 + signum)
        self._received = signum

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
