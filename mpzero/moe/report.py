"""What the training loop does with a model's mixture-of-experts layers around each iteration and at each log
interval, through the model's `moe_metrics` (metrics.py; a model without MoE layers has none and nothing happens):

- `training_iteration(model, ...)`: around one iteration's forward and backward passes: the auxiliary losses'
  backward scale set (the loss scale over the micro-batches), the EP bytes counted from the first forward to the
  last backward, and after them each router's expert bias moved by the step's token counts (--moe-router-enable-
  expert-bias);
- `moe_log(model, groups)`: a collective at a log interval: the load-balancing and z-losses (Megatron's averages
  over the MoE layers, micro-batches and iterations; summed over the TP ranks' sequence slices, pipeline stages'
  layers, averaged over data-parallel ranks) for the iteration line, the tokens each expert received per layer
  since the last interval (what users watch for a collapsing router) and the last iteration's EP bytes against
  their formula, as lines and as TensorBoard/wandb scalars.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from mpzero.comm import CommGroup, CommStats
from mpzero.moe.metrics import MoEMetrics
from mpzero.moe.router import TopKRouter


def moe_metrics(model) -> MoEMetrics | None:
    return getattr(model, "moe_metrics", None)


def _aside(group: CommGroup) -> CommGroup:
    """The same ranks with a byte counter of their own: the figures' and the bias's reductions are bookkeeping,
    kept off the lines that count the training's bytes (ZeRO's DP line, the pipeline's)."""
    return dataclasses.replace(group, stats=CommStats())


@contextlib.contextmanager
def training_iteration(model, ep: CommGroup, loss_scale: float, micro_batches: int, dp: CommGroup):
    """Around one training iteration's passes (module docstring); `micro_batches`: this rank's; `dp`: the group the
    step's token counts are summed over for the expert bias (DP x CP)."""
    metrics = moe_metrics(model)
    if metrics is None:
        yield
        return
    metrics.set_backward_scale(loss_scale / micro_batches)
    metrics.ep_bytes, before = 0, ep.stats.total()
    yield
    metrics.last_ep = (ep.stats.total() - before, metrics.ep_bytes)
    metrics.iterations += 1
    metrics.micro_batches += micro_batches
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.update_expert_bias(metrics.bias_update_rate, _aside(dp))


def moe_log(model, tp: CommGroup, dp: CommGroup, pp: CommGroup, ep: CommGroup,
            device: torch.device | None = None) -> tuple[dict[str, str], list[str], dict[str, float]]:
    """(fields for the iteration line, lines, scalars) of the interval since the last call, which starts a new
    one; every rank calls it (all-reduces over TP, DP x CP and PP, on `device`). Empty without MoE layers."""
    metrics = moe_metrics(model)
    if metrics is None:
        return {}, [], {}
    tp, dp, pp = _aside(tp), _aside(dp), _aside(pp)
    losses, tokens, device = metrics.losses(), metrics.tokens, device or torch.device("cpu")
    per_rank = torch.zeros(metrics.num_layers, dtype=torch.float64, device=device)
    fields, scalars, lines = {}, {}, []
    moe_layers = sum(1 for layer in range(metrics.num_layers) if metrics.is_moe(layer))
    for name in MoEMetrics.LOSSES:
        values = losses.get(name, per_rank).to(device).clone()
        if metrics.loss_parts_over_tp:
            tp.all_reduce(values)
        pp.all_reduce(values)
        dp.all_reduce(values)
        if name not in losses and not values.any():
            continue
        value = float(values.sum()) / (dp.size * moe_layers * max(metrics.micro_batches, 1))
        fields[name] = f"{value:.6E}"
        scalars[name] = value
    counts = (tokens.to(device).clone() if tokens is not None
              else torch.zeros(metrics.num_layers, metrics.num_experts, dtype=torch.int64, device=device))
    pp.all_reduce(counts)
    dp.all_reduce(counts)
    for layer in range(metrics.num_layers):
        if metrics.is_moe(layer):
            row = counts[layer].tolist()
            lines.append(f"moe tokens per expert | layer {layer} | {' '.join(map(str, row))}")
            mean = sum(row) / len(row)
            scalars[f"moe/layer-{layer}-max-over-mean-tokens"] = max(row) / mean if mean else 0.0
    measured, theory = metrics.last_ep
    ratio = (1.0 if measured == 0 else float("inf")) if theory == 0 else measured / theory
    lines.append(f"moe comm | ep {ep.size} | dispatcher {metrics.dispatcher} | measured bytes/iter {measured:.0f} | "
                 f"theory bytes/iter {theory:.0f} | ratio {ratio:.4f}")
    scalars.update({"moe/ep-comm-bytes-per-iter": measured, "moe/ep-comm-theory-bytes-per-iter": theory})
    metrics.reset()
    return fields, lines, scalars
