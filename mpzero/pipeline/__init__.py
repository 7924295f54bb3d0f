"""Pipeline parallelism: the layers split over pipeline ranks, micro-batches flowing through them by a schedule.

- `config`: `PipelineConfig` (Megatron's flags' meanings) and `stage_layers` (which layers each rank holds);
- `schedules`: each rank's steps as data (1F1B, interleaved 1F1B, ZB-H1, forward only);
- `simulate`: the rules a schedule keeps and its idle time, checked without processes;
- `executor`: one rank's steps run on its model chunks with point-to-point transfers and ZeRO's backward windows;
- `in_flight`: the micro-batches a rank holds at once, counted by the executor beside the schedule's formula;
- `runner`: what the training loop holds per rank (`PipelineSchedule`).

mpzero runs its own executor rather than torch.distributed.pipelining: its schedules must drive ZeRO's gradient
windows (stages 0-2 reduce at the last backward of a rank, whatever its chunk) and split backwards with compiled
layers, which torch's zero-bubble schedules refuse (README, "Pipeline parallelism").
"""

from mpzero.pipeline.config import PipelineConfig, check_composition, stage_layers, virtual_stages
from mpzero.pipeline.executor import StageRun, run_schedule
from mpzero.pipeline.accounting import p2p_theory
from mpzero.pipeline.in_flight import HeldActivations, InFlightReport, formula_bytes, held_formula, in_flight_report
from mpzero.pipeline.runner import PipelineSchedule, pipeline_schedule
from mpzero.pipeline.schedules import SCHEDULES, Action, Pipeline, build, forward_only, peer
from mpzero.pipeline.simulate import Deadlock, Replay, ScheduleError, Simulation, Times, bubble, check, simulate

__all__ = ["Action", "Deadlock", "HeldActivations", "InFlightReport", "Pipeline", "PipelineConfig", "PipelineSchedule",
           "Replay", "SCHEDULES", "ScheduleError", "Simulation", "StageRun", "Times", "bubble", "build", "check",
           "check_composition", "formula_bytes", "forward_only", "held_formula", "in_flight_report", "p2p_theory",
           "peer", "pipeline_schedule", "run_schedule", "simulate", "stage_layers", "virtual_stages"]
