"""Which samples each data-parallel rank trains on, in an order that does not depend on the layout.

Iteration after iteration the global order 0, 1, 2, ... is consumed `global_batch` samples at a time.
As in Megatron's pretraining sampler, micro-step m of a global batch starting at `consumed` covers
the `micro * dp` samples from consumed + m*micro*dp, and DP rank r takes `micro` consecutive ones of
them. Every layout therefore trains each global batch on the same set of samples. Under context parallelism
every CP rank of a DP rank loads the same samples and keeps its part of each sequence (`inputs_and_labels`).
"""

from __future__ import annotations

import numpy as np
import torch

from mpzero.comm import CommGroup
from mpzero.context_parallel import split_batch
from mpzero.errors import ConfigError


def num_micro_batches(global_batch: int, micro_batch: int, dp_size: int) -> int:
    if global_batch % (micro_batch * dp_size) != 0:
        raise ConfigError(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                          f"{micro_batch} x data-parallel size {dp_size} = {micro_batch * dp_size}: "
                          f"pick a global batch that is a multiple of {micro_batch * dp_size}")
    return global_batch // (micro_batch * dp_size)


def micro_batch_indices(consumed: int, global_batch: int, micro_batch: int, dp_rank: int,
                        dp_size: int) -> list[range]:
    """This DP rank's sample indices for each micro-step of the global batch that starts at `consumed`."""
    steps = num_micro_batches(global_batch, micro_batch, dp_size)
    starts = (consumed + m * micro_batch * dp_size + dp_rank * micro_batch for m in range(steps))
    return [range(start, start + micro_batch) for start in starts]


def load_batch(dataset, indices: range, device: torch.device) -> torch.Tensor:
    """[len(indices), seq+1] int64 token ids; inputs are [:, :-1] and labels [:, 1:]."""
    rows = torch.from_numpy(np.stack([np.asarray(dataset[i]["tokens"], dtype=np.int64) for i in indices]))
    if device.type == "cuda":  # pinned host memory: the copy is a DMA that does not block the host
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


def inputs_and_labels(dataset, indices: range, device: torch.device,
                      cp: CommGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, labels) [len(indices), seq/CP] of the samples `indices`: the tokens at the positions
    of its two chunks (`mpzero.context_parallel.ZigzagChunks`); at CP 1 the views [:, :-1] and [:, 1:] of one
    batch."""
    return split_batch(load_batch(dataset, indices, device), cp.size, cp.rank)


class MicroBatches:
    """A global batch's micro-batches on this DP rank, each loaded once, when a pipeline stage first asks for its
    inputs (the stage that begins the model) or labels (the stage that ends it); other stages load nothing. Under
    context parallelism each is this CP rank's part (`inputs_and_labels`), cut once at its load."""

    def __init__(self, dataset, indices: list[range], device: torch.device, cp: CommGroup):
        self.dataset, self.indices, self.device, self.cp = dataset, indices, device, cp
        self._loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _split(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if micro_batch not in self._loaded:
            self._loaded[micro_batch] = inputs_and_labels(self.dataset, self.indices[micro_batch], self.device,
                                                          self.cp)
        return self._loaded[micro_batch]

    def tokens(self, micro_batch: int) -> torch.Tensor:
        return self._split(micro_batch)[0]

    def labels(self, micro_batch: int) -> torch.Tensor:
        return self._split(micro_batch)[1]
