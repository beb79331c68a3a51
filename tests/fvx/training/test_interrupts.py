"""fvx.training.interrupts.Signals in this process: SIGTERM and SIGINT each set the flag (the first one's number) and
leave the process running; leaving the block restores the handlers it replaced. (A run stopped by either one, end to
end: tests/fvx/training/test_reliability.py.)"""
import os
import signal

import pytest

from fvx.training import interrupts


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_either_signal_sets_the_flag_and_the_handlers_come_back(signum):
    before = {s: signal.getsignal(s) for s in interrupts.Signals.SIGNALS}
    with interrupts.Signals() as signals:
        assert signals.received is None
        os.kill(os.getpid(), signum)
        assert signals.received == signum
    assert {s: signal.getsignal(s) for s in interrupts.Signals.SIGNALS} == before
