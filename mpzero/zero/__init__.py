"""ZeRO data parallelism (stages 0-3) over the DP group, with mixed precision and counted memory/communication.

Seams: `ZeroStage` (stage_base.py) is what a stage provides to the front; `MasterStore` (masters.py) owns the
fp32 masters and the update rule's states (`mpzero.optim`) and writes the parameters; `ZeroOptimizer`
(optimizer.py) composes them; `tiers.py` is what a store writes parameters through and the bytes every holder of
model state reports per tier (the offload tiers, `mpzero.zero.offload`, are one more store and sink).

The rest of the face is what the memory planner (`mpzero.planner`) reads to predict a layout without building it:
the flat layouts and stage 3's units, and the accounting's formulas."""

from mpzero.zero.accounting import (CommReport, MemoryReport, PeakReport, TierReport, TransferReport, comm_theory,
                                    counted_ratio, memory_formula, memory_report, offload_formula, offload_tiers,
                                    state_terms, step_fp32_bytes, streamed_grad_bytes, transfer_theory)
from mpzero.zero.config import (DIRECT_IO_ALIGN, OFFLOAD_IO, OFFLOAD_TIERS, ZERO_UNITS, AdamConfig, OffloadConfig,
                                OptimizerConfig, PrecisionConfig, ZeroConfig, check_fp8_param_gather, check_zero_units)
from mpzero.zero.construction import construction_working_set
from mpzero.zero.device_scaler import scaled_loss
from mpzero.zero.device_step import DeviceStep, settle, settle_values
from mpzero.zero.flat import FlatLayout, bucket_layouts, build_layout, mark_weight_decay
from mpzero.zero.fp8_gather import fp8_weight_modules, gather_terms, gathered_bytes, unit_held_bytes
from mpzero.zero.masters import DeviceMasters, MasterStore, OwnedPiece
from mpzero.zero.norm import read_to_host
from mpzero.zero.optimizer import GradientCheck, StepStats, ZeroOptimizer
from mpzero.zero.schedule3 import Replay, predicted_trace, recompute_chunks, stage3_working_set
from mpzero.zero.families import families_working_set
from mpzero.zero.stage3 import Stage3, assign_params, default_units, expert_units, layer_units
from mpzero.zero.stage_base import ZeroStage
from mpzero.zero.tiers import OffloadHolder, ParamSink, TensorParamSink, TierBytes, Transfers

__all__ = ["AdamConfig", "CommReport", "DIRECT_IO_ALIGN", "DeviceMasters", "DeviceStep", "FlatLayout", "GradientCheck",
           "MasterStore", "MemoryReport", "OFFLOAD_IO", "OFFLOAD_TIERS", "OffloadConfig", "counted_ratio",
           "OffloadHolder", "OptimizerConfig", "OwnedPiece", "ParamSink", "PeakReport", "PrecisionConfig", "Replay",
           "Stage3", "StepStats", "TensorParamSink", "TierBytes", "TierReport", "TransferReport", "Transfers",
           "ZERO_UNITS", "ZeroConfig", "ZeroOptimizer", "ZeroStage", "assign_params", "bucket_layouts",
           "build_layout", "check_fp8_param_gather", "check_zero_units", "comm_theory", "construction_working_set",
           "default_units", "expert_units", "families_working_set", "fp8_weight_modules", "gather_terms",
           "gathered_bytes", "layer_units", "unit_held_bytes",
           "mark_weight_decay", "memory_formula", "memory_report", "offload_formula", "offload_tiers",
           "predicted_trace", "read_to_host", "recompute_chunks", "scaled_loss", "settle", "settle_values",
           "stage3_working_set", "state_terms",
           "step_fp32_bytes", "streamed_grad_bytes", "transfer_theory"]
