"""What a model's mixture-of-experts layers share: the scale their auxiliary losses' gradients take in backward, and
the figures they record while training (per layer: the load-balancing loss, the z-loss, the tokens each expert
received, the rows each all-to-all sent to other ranks).

The auxiliary losses reach the loss from any pipeline stage the way Megatron's MoEAuxLossAutoScaler makes them:
`attach(x, loss)` returns `x` unchanged, and in backward the loss receives the gradient `backward_scale`, which the
training loop sets to what the language-model loss of one micro-batch is multiplied by (the fp16 loss scale over
the micro-batches, `set_backward_scale`). So the gradients are those of (mean lm loss + the layers' auxiliary
losses), averaged over micro-batches and data-parallel ranks as the lm loss is, wherever the layer runs: no stage
needs the others' losses and the per-token loss contract of `forward` is unchanged.

Figures are recorded only where a training forward builds the graph (training and grad enabled: under full
recomputation that is the replay in backward, not the forward without grad), so every micro-batch counts once.
They stay on the device, summed over micro-batches and iterations, until `report` reduces and reads them (a log
interval): Megatron's averages, the losses over the MoE layers, micro-batches and iterations, divided by their
coefficients.
"""

from __future__ import annotations

import torch


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, metrics: "MoEMetrics") -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.metrics = metrics
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.metrics.backward_scale), None


class MoEMetrics:
    """The shared record of a model's MoE layers (module docstring). `moe_layers`: for each of the model's layers
    (the record is indexed by global layer) whether it is MoE; `num_experts`: routed experts per layer;
    `loss_parts_over_tp`: each TP rank records its sequence slice's part of the losses (sequence parallel);
    `bias_update_rate`: --moe-router-bias-update-rate (the routers' expert bias, report.py); `dispatcher`: the
    --moe-token-dispatcher-type the comm line names."""

    LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")

    def __init__(self, moe_layers: list[bool], num_experts: int, loss_parts_over_tp: bool = False,
                 bias_update_rate: float = 0.0, dispatcher: str = "allgather"):
        self.num_layers, self.num_experts, self.moe_layers = len(moe_layers), num_experts, list(moe_layers)
        self.loss_parts_over_tp, self.bias_update_rate, self.dispatcher = (loss_parts_over_tp, bias_update_rate,
                                                                           dispatcher)
        self.last_ep = (0, 0)  # the last iteration's EP bytes: (counted, by formula)
        self.backward_scale = 1.0
        self.layers: set[int] = set()  # the MoE layers that recorded something
        self._losses: dict[str, torch.Tensor] = {}
        self.tokens: torch.Tensor | None = None  # [layers, experts] routed tokens (after the capacity drop)
        self.ep_bytes = 0  # what the dispatchers' EP exchanges send by their formula (dispatch.py), this iteration
        self.micro_batches = 0  # training forwards of the whole model since the last reset (first MoE layer)
        self.iterations = 0  # training iterations since the last reset

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def set_backward_scale(self, scale: float) -> None:
        self.backward_scale = float(scale)

    def attach(self, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """x, with `loss` added to the objective in backward (module docstring)."""
        return _Attach.apply(x, loss, self)

    def record_loss(self, name: str, layer: int, value: torch.Tensor) -> None:
        values = self._losses.get(name)
        if values is None:
            values = self._losses[name] = torch.zeros(self.num_layers, dtype=torch.float64, device=value.device)
        values[layer] += value.detach().to(torch.float64)

    def record_tokens(self, layer: int, counts: torch.Tensor) -> None:
        if self.tokens is None:
            self.tokens = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=counts.device)
        self.tokens[layer] += counts
        self.layers.add(layer)

    def reset(self) -> None:
        self._losses, self.tokens, self.micro_batches, self.iterations = {}, None, 0, 0

    def losses(self) -> dict[str, torch.Tensor]:
        return dict(self._losses)
