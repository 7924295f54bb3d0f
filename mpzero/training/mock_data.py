"""Deterministic random token samples, for runs and tests that need no dataset on disk (`--mock-data`)."""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """Sample i counts up from a random start (t, t+1, t+2, ... mod vocab), the start drawn from a
    generator keyed by (seed, i): the same sample whatever the layout or the order samples are asked
    for, and learnable, so a run's loss visibly falls (like Megatron's mock dataset)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int):
        self.vocab_size, self.seq_length, self.seed, self.num_samples = vocab_size, seq_length, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng((self.seed, index))
        start = rng.integers(0, self.vocab_size)
        return {"tokens": (start + np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size}
