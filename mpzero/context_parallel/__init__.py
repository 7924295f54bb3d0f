"""Context parallelism (`--context-parallel-size`, `--cp-comm-type`): the sequence split over the CP ranks of the
grid (`ParallelGroups.cp`), load-balanced for causal attention (`chunks.py`), and the attention that sees the
whole sequence from its part: the ring or the all-gather of keys and values (`attention.py`, `transports.py`,
`blocks.py`), or the all-to-all over heads (`ulysses.py`). Every other layer is per token and runs on the local
tokens unchanged; parameters are replicated over CP and their gradients reduced over DP x CP (ZeRO's group)."""

from mpzero.context_parallel.attention import ContextParallel, context_attention
from mpzero.context_parallel.blocks import TILE_ROWS
from mpzero.context_parallel.checks import CP_COMM_TYPES, check_context_parallel
from mpzero.context_parallel.chunks import ZigzagChunks, split_batch
from mpzero.context_parallel.kernels import block_kernel
from mpzero.context_parallel.traffic import cp_comm_line, cp_comm_theory
from mpzero.context_parallel.ulysses import heads_to_sequence, sequence_to_heads

__all__ = ["CP_COMM_TYPES", "TILE_ROWS", "ContextParallel", "ZigzagChunks", "block_kernel", "check_context_parallel",
           "context_attention", "cp_comm_line", "cp_comm_theory", "heads_to_sequence", "sequence_to_heads",
           "split_batch"]
