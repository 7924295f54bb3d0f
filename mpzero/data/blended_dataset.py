"""Several datasets mixed by weight (`--data-path 0.3 A 0.7 B`), with Megatron-LM's blending order.

Sample i goes to the dataset whose count lags its target share the most: the one maximising
weight_d * max(i, 1) - taken_d (lowest index on ties; a dataset of weight 0 never), and takes that
dataset's next sample. After any prefix of n samples each dataset has supplied weight_d * n of them to
within one sample, so a run that stops early or resumes from a consumed-samples count still sees the
requested mixture.
"""

from __future__ import annotations

import numpy as np

from mpzero.errors import ConfigError


def build_blending_indices(weights: list[float], size: int) -> dict[str, np.ndarray]:
    """dataset_index[i] (which dataset) and dataset_sample_index[i] (its sample) for i < size."""
    dataset_index, dataset_sample_index = [], []
    taken = [0] * len(weights)
    # Only positive weights compete: with Megatron's loop a weight-0 dataset listed first wins the tie at
    # error 0 and is asked for a sample it was never built for.
    candidates = [d for d, w in enumerate(weights) if w > 0]
    if not candidates:
        raise ConfigError(f"blend weights {weights} have no positive weight: give at least one")
    first, datasets = candidates[0], candidates[1:]
    # A plain loop, as in Megatron's C++ helper; ~1 s per million samples, and it is built once, cached.
    for i in range(size):
        scale = max(i, 1)
        best, best_error = first, weights[first] * scale - taken[first]
        for d in datasets:
            error = weights[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index.append(best)
        dataset_sample_index.append(taken[best])
        taken[best] += 1
    return {"dataset_index": np.array(dataset_index, dtype=np.int16),
            "dataset_sample_index": np.array(dataset_sample_index, dtype=np.int64)}


class BlendedDataset:
    """Sample i -> the `dataset_sample_index[i]`-th sample of dataset `dataset_index[i]`."""

    def __init__(self, datasets: list, indices: dict[str, np.ndarray]):
        self.datasets = datasets
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a blended dataset of {len(self)} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
