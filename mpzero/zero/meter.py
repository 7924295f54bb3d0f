"""Counts the transient model-state bytes of a step (gathered parameter units, full gradient buckets) as the
buffers that hold them are created and freed, and keeps the high-water mark: the in-step peak that a count
taken between steps never sees."""

from __future__ import annotations


class TransientMeter:
    def __init__(self):
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes
