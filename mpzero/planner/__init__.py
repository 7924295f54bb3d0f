"""Memory planning from the code's own layouts and formulas: `tools/plan_memory.py` (layouts, bytes per rank, cost)
and `pretrain_gpt.py --dry-run` (the real code on fake tensors) share it.

- `plan`: `Planner` evaluates every layout (`Layout`) of a run on a `Machine` into `LayoutPlan`s; `rank_plans`.
- `pipeline`: each pipeline rank's stage, its micro-batches in flight, the bubble and point-to-point bytes.
- `states`: `plan_states`, one rank's model-state bytes, its in-step peak and DP traffic, from `PlanInputs`.
- `shapes`: `model_shapes`, the model's parameter layouts without building a parameter.
- `choices`: what a layout may choose (schedules, CP, offload tiers, EP and expert-TP).
- `experts`: a mixture of experts' stated routing (worst case, balanced) and its EP bytes.
- `activations`, `transients`, `cost`: activation bytes, the step's working tensors, the time model (`Hardware`).
- `fake`: tensors without data (`no_data`), what the dry run builds on.
- `report`: the table's rows and the torchrun command of a layout.
- `published`: the ZeRO paper's and DeepSpeed's own estimates, to compare with.
"""

from mpzero.planner.activations import ActivationPlan, activation_plan, activation_setting, normalized
from mpzero.planner.cost import Cost, Hardware, layout_cost
from mpzero.planner.experts import (ROUTINGS, balanced_rows, ep_comm_bytes, plan_moe_shape, recomputed_layers,
                                    routing_text)
from mpzero.planner.fake import ENGINES, engine_device, fake_tensors, no_data
from mpzero.planner.pipeline import (bubble_fraction, hidden_state_bytes, in_flight_bytes, pipeline_comm_bytes,
                                     pipeline_stages, stage_classes, tied_bytes)
from mpzero.planner.plan import RECOMPUTE_MODES, TIERS, Layout, LayoutPlan, Machine, Planner, RunSections, rank_plans
from mpzero.planner.report import (GIB, HEADER, LAYOUT_FLAGS, components_text, gib, layout_argv, row,
                                   torchrun_command, without_layout_flags)
from mpzero.planner.shapes import ModelShapes, full_recompute_chunks, model_shapes
from mpzero.planner.states import PlanInputs, StatePlan, element_sizes, plan_states, tp_comm_bytes

__all__ = ["ROUTINGS", "balanced_rows", "ep_comm_bytes", "plan_moe_shape", "recomputed_layers", "routing_text",
           "ActivationPlan", "Cost", "ENGINES", "GIB", "HEADER", "Hardware", "LAYOUT_FLAGS", "Layout", "LayoutPlan",
           "Machine", "ModelShapes", "PlanInputs", "Planner", "RECOMPUTE_MODES", "RunSections", "StatePlan", "TIERS",
           "activation_plan", "activation_setting", "bubble_fraction", "components_text", "element_sizes",
           "engine_device", "fake_tensors", "full_recompute_chunks", "gib", "hidden_state_bytes", "in_flight_bytes",
           "layout_argv", "layout_cost", "model_shapes", "no_data", "normalized", "pipeline_comm_bytes",
           "pipeline_stages", "plan_states", "rank_plans", "row", "stage_classes", "tied_bytes", "torchrun_command",
           "tp_comm_bytes", "without_layout_flags"]
