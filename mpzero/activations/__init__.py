"""Activation memory: what a forward keeps for its backward, by formula (`formula.py`, with its inputs in
`setting.py` and the terms outside the layers in `outside.py`: one source of truth for the training line and for
planners; what zero bubble's deferred weight gradients hold in `deferred.py`) and counted (`count.py`, saved-tensor
hooks), and the line that puts the two side by side (`report.py`)."""

from mpzero.activations.count import (COMPILED_TRUNK, SavedBytesCounter, activation_region, host_offload,
                                      note_exchange, note_expert_rows)
from mpzero.activations.deferred import deferred_bytes, deferred_layer_terms
from mpzero.activations.formula import (ActivationFormula, LayerFormula, activation_formula, exchange_term,
                                        layer_formula, layer_kinds, mode_name, modeled, paper_row)
from mpzero.activations.moe import MoEShape, dispatched_tokens, moe_shape, worst_case_rows
from mpzero.activations.outside import embedding_terms, head_terms, kept_chunk_tokens, outside_terms
from mpzero.activations.report import activation_line, rank_report, report_activation_memory
from mpzero.activations.setting import (CPU_RNG_STATE_BYTES, CUDA_RNG_STATE_BYTES, GRANULARITIES, METHODS,
                                        ActivationSetting, Term, check_setting)

__all__ = ["dispatched_tokens", "worst_case_rows", "COMPILED_TRUNK", "CPU_RNG_STATE_BYTES", "CUDA_RNG_STATE_BYTES",
           "GRANULARITIES", "METHODS", "ActivationFormula", "ActivationSetting", "LayerFormula", "SavedBytesCounter",
           "Term", "activation_formula", "activation_line", "activation_region", "check_setting", "deferred_bytes",
           "deferred_layer_terms", "embedding_terms", "exchange_term", "head_terms", "host_offload",
           "kept_chunk_tokens", "layer_formula", "layer_kinds", "mode_name", "modeled", "MoEShape", "moe_shape",
           "note_exchange", "note_expert_rows", "outside_terms", "paper_row", "rank_report", "report_activation_memory"]
