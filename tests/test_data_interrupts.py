"""Signals as exceptions in the data tools, with real signals sent to this process."""

import os
import signal

import pytest

from mpzero.data.interrupts import Interrupted, deferred_interrupts, signals_as_interrupts


def test_sigterm_raises_at_once_outside_a_deferred_block_and_after_it_inside():
    before = signal.getsignal(signal.SIGTERM)
    with signals_as_interrupts():
        with pytest.raises(Interrupted, match="interrupted by SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs between bytecodes of the main thread
                pass
        steps = []
        with pytest.raises(Interrupted) as stop:
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10**5):
                    pass
                steps.append("finished")  # the block is not torn
        assert steps == ["finished"] and stop.value.signum == signal.SIGTERM
        with deferred_interrupts(reraise=False):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**5):
                pass
    assert signal.getsignal(signal.SIGTERM) is before
