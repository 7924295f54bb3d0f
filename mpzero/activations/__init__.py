"""Activation memory: what a forward keeps for its backward, by formula (`formula.py`, one source of truth for
the training line and for planners) and counted (`count.py`, saved-tensor hooks), and the line that puts the
two side by side (`report.py`)."""

from mpzero.activations.count import SavedBytesCounter, activation_region, host_offload
from mpzero.activations.formula import (ActivationFormula, ActivationSetting, LayerFormula, Term,
                                        activation_formula, layer_formula, outside_terms, paper_row)

__all__ = ["ActivationFormula", "ActivationSetting", "LayerFormula", "SavedBytesCounter", "Term",
           "activation_formula", "activation_region", "host_offload", "layer_formula", "outside_terms",
           "paper_row"]
