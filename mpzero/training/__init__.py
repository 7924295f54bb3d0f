"""The training loop and its pieces. `loop.py` is the model-agnostic loop: it takes a frozen `RunConfig`
(`config.py`: typed sections, never the parsed flags) and a model provider (`provider(model_config, groups,
rng) -> BuiltModel(module, flops_per_token)`); each iteration is `train_step` (`forward_backward` over one global
batch, the gradient check, the optimizer step) and then the decisions to log, evaluate, save and stop;
`state.py` what it trains (the model, its optimizer, a pipeline rank's schedules), `passes.py` one global batch's
forward and backward (or evaluation); `startup.py` is what a run checks and prints before the model is built. Around it: batch order, mock data, the LR
schedule, console lines, TensorBoard, peak memory, MFU, Megatron's --profile (`profiling.py`), and SIGTERM
handling."""

from mpzero.training.batches import load_batch, micro_batch_indices, num_micro_batches
from mpzero.training.config import (CheckpointConfig, DataConfig, DryRunConfig, EvalConfig, LoggingConfig,
                                    ParallelConfig, ProfileConfig, RunConfig, TrainingConfig)
from mpzero.training.loop import Progress, StepResult, every_stage, save, train, train_step
from mpzero.training.passes import evaluate, forward_backward
from mpzero.training.state import (BuiltModel, ModelProvider, TrainingState, build_training_state, overlap_note,
                                   partition_note)
from mpzero.training.lr_schedule import DECAY_STYLES, LRSchedule
from mpzero.training.metrics import MetricsLogger
from mpzero.training.mock_data import MockGPTDataset
from mpzero.training.peak_flops import DATASHEET_BF16_TFLOPS, datasheet_bf16_tflops
from mpzero.training.startup import fused_ops

__all__ = ["BuiltModel", "CheckpointConfig", "DATASHEET_BF16_TFLOPS", "DECAY_STYLES", "DataConfig", "DryRunConfig",
           "EvalConfig", "LRSchedule", "LoggingConfig", "MetricsLogger", "MockGPTDataset", "ModelProvider",
           "ParallelConfig", "ProfileConfig", "Progress", "RunConfig", "StepResult", "TrainingConfig", "TrainingState",
           "build_training_state", "datasheet_bf16_tflops", "evaluate", "every_stage", "forward_backward", "fused_ops", "load_batch",
           "micro_batch_indices", "num_micro_batches", "overlap_note", "partition_note", "save", "train", "train_step"]
