"""Fused ops (LayerNorm, RMSNorm, scaled masked softmax, AdamW over flat partitions, the gradient norm's sum of
squares), each a Triton kernel beside its PyTorch reference, and the chunked cross entropy's arithmetic (reference
and torch.compile'd); `impl` picks the implementation explicitly (see `mpzero.fused.impl`). `sdpa.py` asks whether
torch's fused attention kernels take a run's attention."""

from mpzero.fused.adam import ADAMW_DEVICE_SKIP_IMPLS, adamw_reference, adamw_step
from mpzero.fused.adam_scalars import ADAMW_MASKED_IMPLS, adamw_masked_step, adamw_scalars, pick_row
from mpzero.fused.cross_entropy import CrossEntropyMath, chunked_forward, cross_entropy_math
from mpzero.fused.impl import (ATTENTION_BACKENDS, IMPLS, planned_attention_backend, planned_device_type,
                               planned_impl, resolve_attention_backend, resolve_impl, resolved_impls,
                               triton_available)
from mpzero.fused.layer_norm import layer_norm, layer_norm_reference
from mpzero.fused.rms_norm import rms_norm, rms_norm_reference
from mpzero.fused.sdpa import AttentionShape, fused_attention_refusal
from mpzero.fused.softmax import fused_softmax_supported, scaled_masked_softmax, scaled_masked_softmax_reference
from mpzero.fused.squares import sum_of_squares, sum_of_squares_reference
from mpzero.fused.squares import working_bytes as sum_of_squares_bytes

__all__ = [
    "ADAMW_DEVICE_SKIP_IMPLS", "ADAMW_MASKED_IMPLS", "ATTENTION_BACKENDS", "IMPLS", "adamw_masked_step",
    "adamw_reference", "adamw_scalars", "adamw_step", "AttentionShape", "pick_row",
    "chunked_forward",
    "cross_entropy_math", "CrossEntropyMath", "fused_attention_refusal", "fused_softmax_supported", "layer_norm",
    "layer_norm_reference", "planned_attention_backend", "planned_device_type", "planned_impl",
    "resolve_attention_backend", "resolve_impl",
    "resolved_impls", "rms_norm", "rms_norm_reference", "scaled_masked_softmax", "scaled_masked_softmax_reference",
    "sum_of_squares", "sum_of_squares_bytes", "sum_of_squares_reference", "triton_available",
]
