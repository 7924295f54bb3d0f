"""Which tokens of a sequence each context-parallel rank holds: the load-balanced ("zigzag", "head-tail") split.

A sequence of s tokens is cut into 2·CP chunks of c = s/(2·CP); CP rank r holds chunks r and 2·CP-1-r, in that
order (Megatron's `get_batch_on_this_cp_rank`, torch's `_HeadTailLoadBalancer`). Under a causal mask an early chunk
attends to few keys and a late one to many, so pairing the r-th from the front with the r-th from the back gives
every rank the same attention work. CP 2 on 8 tokens: rank 0 holds positions 0 1 | 6 7, rank 1 holds 2 3 | 4 5.

The split is made once, in the batch loader (`training/batches.py`); the model reads each token's global position
from the same layout (RoPE, learned positions, the causal mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpzero.errors import ConfigError


@dataclass(frozen=True)
class ZigzagChunks:
    """The layout of a `seq_length`-token sequence over `size` CP ranks, seen from CP rank `rank`."""
    seq_length: int
    size: int
    rank: int

    def __post_init__(self):
        if self.seq_length % (2 * self.size):
            raise ConfigError(f"sequence length {self.seq_length} is not divisible by 2 x --context-parallel-size "
                              f"{self.size} = {2 * self.size}: each CP rank holds two of the 2·CP equal chunks")

    @property
    def chunk(self) -> int:
        """c: the tokens of one chunk."""
        return self.seq_length // (2 * self.size)

    @property
    def local_length(self) -> int:
        return 2 * self.chunk

    def chunk_indices(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunks (indices in 0..2·CP-1) rank `rank` (default this one) holds."""
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank

    def positions(self, device=None) -> torch.Tensor:
        """[local_length] int64: the global position of each token this rank holds."""
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_indices()])

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` (the whole sequence along `dim`), contiguous: its two chunks concatenated."""
        if x.size(dim) != self.seq_length:
            raise ValueError(f"a sequence of {x.size(dim)} tokens handed to a {self.seq_length}-token CP layout")
        c = self.chunk
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunk_indices()], dim=dim).contiguous()

    def natural_chunk_order(self) -> list[int]:
        """For the ranks' local tokens concatenated in rank order (2·CP chunks, rank j's two at 2j and 2j+1): the
        index of each global chunk 0..2·CP-1 in that concatenation (the order that restores the sequence)."""
        order = [0] * (2 * self.size)
        for j in range(self.size):
            first, second = self.chunk_indices(j)
            order[first], order[second] = 2 * j, 2 * j + 1
        return order

    def rank_major_chunk_order(self) -> list[int]:
        """The inverse of `natural_chunk_order`: for each chunk of the rank-order concatenation, its global index."""
        return [i for j in range(self.size) for i in self.chunk_indices(j)]


def split_batch(tokens: torch.Tensor, cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [b, s + 1] token batch -> this CP rank's (inputs, labels), each [b, s/CP]: inputs are tokens[:, :-1] and
    labels tokens[:, 1:] at the positions the rank holds. At CP 1 both are views of `tokens`, as before CP."""
    if cp_size == 1:
        return tokens[:, :-1], tokens[:, 1:]
    layout = ZigzagChunks(tokens.size(1) - 1, cp_size, cp_rank)
    return layout.take(tokens[:, :-1]), layout.take(tokens[:, 1:])
