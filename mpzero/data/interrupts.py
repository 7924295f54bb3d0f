"""SIGTERM handled like Ctrl-C in the data tools: the signal becomes an exception, so the writers' cleanup
(`except BaseException: abort()`) removes their temporary files and the tool exits with one line.

    with signals_as_interrupts():          # in a tool's main(), in the main thread
        ...                                # SIGINT/SIGTERM raise Interrupted(signum) here
        with deferred_interrupts():        # a step that must not be torn (renaming outputs into place)
            ...                            # a signal here is raised when the block ends
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from typing import Iterator

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_deferred: list[list[int]] = []  # one list per open deferred_interrupts() block: signals that arrived in it


class Interrupted(BaseException):
    """A SIGINT or SIGTERM; a BaseException, like KeyboardInterrupt, so `except Exception` lets it pass."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def _raise(signum, frame) -> None:
    if _deferred:
        _deferred[-1].append(signum)
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted while inside; the previous handlers come back after."""
    previous = {s: signal.signal(s, _raise) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred_interrupts(reraise: bool = True) -> Iterator[None]:
    """A signal arriving inside is held until the block has finished, then raised as Interrupted, or with
    reraise=False dropped (the block was the last step: the work is complete and the process ends anyway)."""
    _deferred.append([])
    try:
        yield
    finally:
        arrived = _deferred.pop()
    if arrived and reraise:
        raise Interrupted(arrived[0])


def worker_signals() -> None:
    """For pool worker processes. Ctrl-C and SIGTERM sent to the whole process group (a terminal, a batch
    scheduler, `timeout`) are ignored: the main process handles them and shuts the pool down in order. A
    worker killed by the signal mid-task could leave the pool's queues locked and the main process waiting on
    them forever. On Linux a worker gets SIGKILL when the main process dies, so a killed main leaves no
    orphan workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        except (OSError, AttributeError):
            pass  # no prctl: orphans then end when their next read from the pool's queue fails
