"""Megatron-style tensor parallelism: region collectives, parallel layers, vocab-parallel cross entropy, RNG,
and the per-parameter placement contract (`placement.py`) every parameter handed to ZeRO must satisfy; FP8 matmuls
in the parallel linears through torchao (`fp8.py`)."""

from mpzero.tensor_parallel.fp8 import (FP8_FORMATS, FP8_RECIPES, Fp8Recipe, amax_reduced_elements, check_fp8_flags,
                                        convert_to_fp8, layer_linears)
from mpzero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from mpzero.tensor_parallel.layers import (ColumnParallelLinear, InitMethod, RowParallelLinear, VocabParallelEmbedding,
                                           gather_full, linear_with_sequence_gather, ones_, sharded_parameter, zeros_)
from mpzero.tensor_parallel.placement import (TensorPlacement, is_expert, is_pipeline_copy, is_pipeline_tied,
                                              mark_pipeline_tied,
                                              mark_replicated, mark_tensor_parallel, placement_of, placements,
                                              tp_slice, tp_unslice)
from mpzero.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence_parallel, gather_from_tp,
                                             reduce_from_tp, reduce_scatter_to_sequence_parallel,
                                             scatter_to_sequence_parallel, scatter_to_tp)
from mpzero.tensor_parallel.random import RNGStatesTracker, recompute, seed_everything
from mpzero.tensor_parallel.weight_grad import WeightGradStore

__all__ = [
    "FP8_FORMATS", "FP8_RECIPES", "Fp8Recipe", "amax_reduced_elements", "check_fp8_flags", "convert_to_fp8",
    "layer_linears",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy", "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
    "mark_tensor_parallel", "mark_replicated",
    "placement_of", "placements", "TensorPlacement", "sharded_parameter", "gather_full", "RNGStatesTracker",
    "recompute", "seed_everything", "scatter_to_sequence_parallel", "reduce_scatter_to_sequence_parallel",
    "gather_from_sequence_parallel", "linear_with_sequence_gather", "InitMethod", "ones_", "zeros_", "tp_slice",
    "tp_unslice", "WeightGradStore", "is_pipeline_copy", "is_pipeline_tied", "mark_pipeline_tied",
    "is_expert",
]
