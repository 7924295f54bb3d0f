"""The part of the transformer one pipeline rank builds (`ModelStage`) and the container its layers live in
(`LayerStack`).

A pipeline rank holds one or more model chunks (Megatron's virtual stages), each a run of consecutive transformer
layers; the rank that holds the first chunk of the model also holds the embedding, the one with the last chunk
the final norm, the output layer and the loss. Layers keep their global index as their name (`layers.7.…` on
whichever rank holds layer 7, as torchtitan's ModuleDict and Megatron's global layer offset do), so a stage's
parameter names are the whole model's: its initial weights (drawn per name, `mpzero.deferred_init`) and checkpoint
keys are those of one process, and a checkpoint moves between pipeline sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelStage:
    """Layers by model chunk (global indices, consecutive within a chunk); `first`: chunk 0 begins the model
    (takes tokens through the embedding); `last`: the last chunk ends it (final norm, output layer, loss)."""
    chunks: tuple[tuple[int, ...], ...]
    first: bool = True
    last: bool = True

    @staticmethod
    def whole(num_layers: int) -> ModelStage:
        return ModelStage((tuple(range(num_layers)),))

    @property
    def is_whole(self) -> bool:
        return self.first and self.last and len(self.chunks) == 1

    def begins(self, chunk: int) -> bool:
        """Whether `chunk` is the model's first virtual stage."""
        return self.first and chunk == 0

    def ends(self, chunk: int) -> bool:
        """Whether `chunk` is the model's last virtual stage."""
        return self.last and chunk == len(self.chunks) - 1

    def positions(self, chunk: int) -> slice:
        """Where the chunk's layers lie in the rank's `LayerStack`."""
        start = sum(len(c) for c in self.chunks[:chunk])
        return slice(start, start + len(self.chunks[chunk]))


class LayerStack(nn.ModuleList):
    """The transformer layers a model holds, registered under their global index (so a stage names its parameters
    as the whole model does); indexed and iterated by position, like a list. An `nn.ModuleList`, so ZeRO-3 finds
    its units in it."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)
        self.indices = tuple(layers)

    def __getitem__(self, position):
        return list(self._modules.values())[position]
