"""What the training loop trains: the model a provider builds (`BuiltModel`), with its ZeRO optimizer and, under
pipeline parallelism, this rank's schedules (`TrainingState`, made once per run by `build_training_state`), and
the notes said about them at start.

A model provider is one function, `provider(model_config, groups, rng) -> BuiltModel`: the module (its
`forward(tokens, labels)` returns per-token losses [b, s]; every trainable parameter marked with its TP
placement) and its FLOPs per trained token (for TFLOP/s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from mpzero.parallel import ParallelGroups
from mpzero.pipeline import PipelineSchedule, pipeline_schedule
from mpzero.tensor_parallel import RNGStatesTracker, seed_everything
from mpzero.training.batches import num_micro_batches
from mpzero.training.config import RunConfig
from mpzero.zero import ZeroOptimizer


@dataclass(frozen=True)
class BuiltModel:
    module: nn.Module
    flops_per_token: float  # model FLOPs of forward + backward per trained token
    architecture: dict = field(default_factory=dict)  # {flag name: value} that give the weights their meaning:
    # saved with every checkpoint; loading one saved with other values is refused


ModelProvider = Callable[[Any, ParallelGroups, RNGStatesTracker], BuiltModel]


@dataclass
class TrainingState:
    """What the loop trains: built once per run by `build_training_state`."""
    groups: ParallelGroups
    model: BuiltModel
    optimizer: ZeroOptimizer
    rng: RNGStatesTracker
    pipeline: PipelineSchedule | None = None  # pipeline parallelism: this rank's schedules (mpzero.pipeline)


def build_training_state(run: RunConfig, provider: ModelProvider, groups: ParallelGroups) -> TrainingState:
    """Seeds every generator, builds the model through `provider` (a pipeline rank: its stage) and its ZeRO
    optimizer, and a pipeline rank's schedules."""
    rng = seed_everything(run.training.seed, groups.tp_rank, groups.device, groups.pp_rank)
    built = provider(run.model, groups, rng)
    optimizer = ZeroOptimizer(built.module, groups, run.zero, run.optimizer, run.precision, offload=run.offload)
    schedule = None
    if groups.pp_size > 1:
        training = run.training
        micro_batches = num_micro_batches(training.global_batch_size, training.micro_batch_size, groups.dp_size)
        schedule = pipeline_schedule(run.pipeline, groups, built.module, training.micro_batch_size,
                                     training.seq_length, micro_batches, run.precision.torch_dtype,
                                     optimizer.tied_gradient_bytes(),
                                     p2p_timeout=run.parallel.distributed_timeout_minutes * 60)
    return TrainingState(groups, built, optimizer, rng, schedule)


def overlap_note(optimizer: ZeroOptimizer) -> str | None:
    """A line saying that overlapping gradient reduction with backward cannot happen for this model, or None.
    It cannot when every parameter sits in one gradient bucket (stages 0-2: the bucket is complete, and
    reduced, only when backward is over) or in one stage-3 unit; with one DP rank nothing is reduced at all."""
    zero, layouts, numel = optimizer.zero, optimizer.stage.layouts, optimizer.numel
    if not zero.overlap_comm or optimizer.groups.dp_size == 1 or len(layouts) != 1:
        return None
    if zero.stage == 3:
        return (f"note: ZeRO stage 3 found no units in this model (no nn.ModuleList; all {numel} parameters are "
                f"one unit), so gathering and reducing cannot overlap with compute: pass units= to ZeroOptimizer")
    return (f"note: --zero-bucket-numel {zero.bucket_numel} holds all {numel} trainable parameters of this rank "
            f"in one gradient bucket, reduced only once backward is over: nothing overlaps with it; a bucket of "
            f"about {max(numel // 4, 1)} elements reduces in 4 parts while backward runs")


def partition_note(optimizer: ZeroOptimizer) -> str | None:
    """At DP 1 a ZeRO stage above 0 partitions nothing: said once, so nobody reads its memory as savings."""
    if optimizer.groups.dp_size > 1 or optimizer.zero.stage == 0:
        return None
    return (f"note: data-parallel size 1: ZeRO stage {optimizer.zero.stage} partitions nothing (every state is "
            f"whole on this rank); run more data-parallel ranks to divide it")
