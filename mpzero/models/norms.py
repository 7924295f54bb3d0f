"""RMSNorm, LLaMA's normalization, as a replicated module beside GPT's LayerNorm (`blocks.LayerNorm`): the same
contract (fp32 weight and statistics whatever the storage dtype, the output in the input's dtype; under sequence
parallelism this rank's sequence slice, the weight gradient all-reduced over TP)."""

from __future__ import annotations

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import deferred_parameter
from mpzero.fused import rms_norm
from mpzero.tensor_parallel import copy_to_tp, mark_tensor_parallel, ones_


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the hidden dimension (mpzero.fused.rms_norm); replicated
    across the TP group, weight initialized to ones, no bias. With `tp` given (sequence parallelism) the weight
    gradient is summed over the TP group on its way back, as LayerNorm's (each rank normalized another slice)."""

    def __init__(self, hidden_size: int, eps: float, impl: str = "auto", tp: CommGroup | None = None):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.weight = mark_tensor_parallel(deferred_parameter((hidden_size,), ones_), None)  # made with the model
        self.weight.sequence_parallel = self.tp is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float()
        if self.tp is not None:
            weight = copy_to_tp(weight, self.tp)
        return rms_norm(x, weight, self.eps, impl=self.impl)
