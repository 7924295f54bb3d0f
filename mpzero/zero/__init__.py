"""ZeRO data parallelism (stages 0-3) over the DP group, with mixed precision and counted memory/communication.

Seams: `ZeroStage` (stage_base.py) is what a stage provides to the front; `MasterStore` (masters.py) owns the
fp32 masters and the update rule's states (`mpzero.optim`) and writes the parameters; `ZeroOptimizer` (optimizer.py) composes them."""

from mpzero.zero.accounting import CommReport, MemoryReport, PeakReport
from mpzero.zero.config import AdamConfig, OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.masters import DeviceMasters, MasterStore, OwnedPiece
from mpzero.zero.optimizer import GradientCheck, StepStats, ZeroOptimizer
from mpzero.zero.stage3 import default_units
from mpzero.zero.stage_base import ZeroStage

__all__ = ["AdamConfig", "CommReport", "DeviceMasters", "GradientCheck", "MasterStore", "MemoryReport", "OffloadConfig",
           "OptimizerConfig", "OwnedPiece", "PeakReport", "PrecisionConfig", "StepStats", "ZeroConfig", "ZeroOptimizer",
           "ZeroStage", "default_units"]
