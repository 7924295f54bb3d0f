"""The planner's one call for activation memory: bytes one rank keeps for backward, per layer and per micro-batch,
for a layout. Both halves are the code's own: the GPT's `activation_setting` (what its forward does for this
config, TP rank, dtype and device type) and the activation-memory module's `activation_formula` (the one source
of truth behind the run's `activation memory` line). Where the module does not model the setting (SDPA with
attention dropout on a CPU, which runs its math fallback), the answer is None and the planner says activations
are not counted; it never substitutes a formula of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mpzero.models import family_of


@dataclass(frozen=True)
class ActivationPlan:
    """Device bytes of activations on one rank for one micro-batch in flight."""
    per_layer: tuple[int, ...]  # what each transformer layer keeps after the forward (on the device)
    outside: int  # embedding, final LayerNorm, logits, loss
    recompute_transient: int  # in backward, a recomputed layer's tensors beyond what it kept
    host: int  # kept in host memory (--offload-activations cpu; 0 when not modeled)
    text: str  # the first layer's formula (Korthikanti's row and mpzero's terms)
    in_flight: int | None = None  # a pipeline rank: the bytes of the micro-batches it holds at once
    in_flight_text: str = ""
    formula: object = field(default=None, compare=False, repr=False)  # the ActivationFormula behind it
    routing: str = ""  # a mixture of experts: the routing assumed (`planner.experts.routing_text`)
    balanced: int | None = None  # a mixture of experts: what a micro-batch keeps at balanced routing

    @property
    def saved(self) -> int:
        """What a micro-batch's forward keeps for its backward (the `activation memory` line's micro-batch)."""
        return sum(self.per_layer) + self.outside

    @property
    def held(self) -> int:
        """What the forwards held at once keep: one micro-batch's, or a pipeline rank's micro-batches in flight."""
        return self.saved if self.in_flight is None else self.in_flight

    @property
    def peak(self) -> int:
        """The most activation bytes alive in a step: the held bytes plus one layer recomputed in backward."""
        return self.held + self.recompute_transient


def activation_setting(config, tp: int, tp_rank: int, micro_batch: int, seq: int, dtype: torch.dtype, cuda: bool):
    """The config's family's `activation_setting` for TP rank `tp_rank` of `tp` (with the one RNG tracker stream
    `seed_everything` adds), on a GPU (`cuda`) or the CPU: what `auto` picks on that device, whether or not
    it could run on this machine; None for a family that states none."""
    family = family_of(config)
    if family.activation_setting is None:
        return None
    return family.activation_setting(config, tp, micro_batch, seq, dtype, torch.device("cuda" if cuda else "cpu"),
                                     tp_rank=tp_rank, rng_streams=1)


def activation_plan(config, tp: int, micro_batch: int, seq: int, dtype: torch.dtype, cuda: bool = True,
                    tp_rank: int = 0, stage=None, ep: int = 1, etp: int | None = None, ep_rank: int = 0,
                    routing: str = "worst") -> ActivationPlan | None:
    """Activation bytes of TP rank `tp_rank` for a micro-batch of `micro_batch` x `seq` tokens of the GPT `config`
    (its recomputation, sequence-parallel and offload settings) at TP `tp`, on a pipeline rank's `stage`
    (`ModelStage`; None: the whole model); None where not modeled. A mixture of experts at EP `ep` (rank
    `ep_rank`) and expert-TP `etp` (None: TP) is taken at `routing` (`planner.experts`: "worst", the dropless
    worst case or the capacity bound; "balanced"), its balanced figure beside."""
    from mpzero.planner.experts import balanced_rows, plan_moe_shape, routing_text
    setting = activation_setting(config, tp, tp_rank, micro_batch, seq, dtype, cuda)
    if setting is not None and config.num_experts:
        setting = dataclasses.replace(setting, moe=plan_moe_shape(config, tp, ep, etp))
    from mpzero.activations import activation_formula, layer_formula, modeled
    if setting is None or modeled(setting) is not None:
        return None
    if stage is not None:
        setting = setting.for_stage(stage.chunks, stage.first, stage.last)
    rows = balanced_rows(setting, ep_rank) if setting.moe is not None else None
    formula = activation_formula(setting, rows if routing == "balanced" else None)
    moe = {} if rows is None else {"routing": routing_text(setting, ep_rank, routing),
                                   "balanced": activation_formula(setting, rows).micro_batch_bytes}
    at = rows if routing == "balanced" and rows is not None else {}  # the heaviest layer of the stage, recomputed
    stored = max((layer_formula(setting, "stored", i, at.get(i)).bytes for i in setting.layer_indices),
                 default=layer_formula(setting, "stored").bytes)
    kinds = {layer.kind for layer in formula.layers}
    # in backward a recomputed layer holds what the stored layer holds until its own backward is done
    transient = 0
    if "checkpoint" in kinds or "selective" in kinds:
        chunk = setting.recompute_num_layers if setting.recompute_method == "uniform" else 1
        kept = max(layer.device_bytes for layer in formula.layers if layer.kind != "stored")
        transient = max(stored * (chunk or 1) - kept, 0)
    host = sum(layer.host_bytes or 0 for layer in formula.layers)
    text = formula.layers[0].text() if formula.layers else "0"
    return ActivationPlan(tuple(formula.layer_bytes), formula.outside_bytes, transient, host, text, formula=formula,
                          **moe)


def normalized(config):
    """`config` with every activation-memory setting at its default: the parameters do not depend on them."""
    names = [f.name for f in dataclasses.fields(config)]
    defaults = {f.name: f.default for f in dataclasses.fields(config)
                if f.name.startswith("recompute") or f.name in ("sequence_parallel", "distribute_saved_activations",
                                                                 "offload_activations")}
    return dataclasses.replace(config, **{k: v for k, v in defaults.items() if k in names})
