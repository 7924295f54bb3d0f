"""ZeRO data parallelism (stages 0-3) over the DP group, with mixed precision and counted memory/communication."""

from mpzero.zero.accounting import CommReport, MemoryReport
from mpzero.zero.config import AdamConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.optimizer import StepStats, ZeroOptimizer
from mpzero.zero.stage3 import default_units

__all__ = ["AdamConfig", "CommReport", "MemoryReport", "PrecisionConfig", "StepStats", "ZeroConfig",
           "ZeroOptimizer", "default_units"]
