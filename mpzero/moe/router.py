"""The router of a mixture-of-experts layer (Megatron's TopKRouter): a replicated [E, h] weight whose logits are
computed in fp32 (fp64 with --moe-router-dtype fp64), and with --moe-router-enable-expert-bias the aux-loss-free
balancing bias (DeepSeek-V3; Megatron's expert_bias buffer, kept in fp32), which steers the choice, never the
gates, and moves after every step by --moe-router-bias-update-rate toward the experts that received fewer tokens
than the mean (`update_expert_bias`).

Under sequence parallelism each tensor-parallel rank routes its own slice of the sequence: the weight enters the
region through `copy_to_tp`, so its gradient is summed over the TP group (the slices' parts), as a LayerNorm's is.
"""

from __future__ import annotations

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import deferred_parameter
from mpzero.errors import ConfigError
from mpzero.tensor_parallel import InitMethod, copy_to_tp, mark_tensor_parallel

ROUTER_DTYPES = {None: torch.float32, "fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(nn.Module):
    """`sp_group`: the TP group under sequence parallelism (None otherwise)."""

    def __init__(self, hidden_size: int, num_experts: int, init: InitMethod, dtype: str | None,
                 expert_bias: bool, sp_group: CommGroup | None):
        super().__init__()
        self.weight = mark_tensor_parallel(deferred_parameter((num_experts, hidden_size), init), None)
        self.dtype, self.sp_group = ROUTER_DTYPES[dtype], sp_group
        # the bias and the step's token counts per expert (buffers: not trained, on the device); None without
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32) if expert_bias else None)
        self.register_buffer("step_tokens", torch.zeros(num_experts, dtype=torch.int64) if expert_bias else None,
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T, h] -> logits [T, E] in the router's dtype."""
        if self.expert_bias is not None and self.expert_bias.device != tokens.device:  # built on the host
            self.expert_bias.data = self.expert_bias.data.to(tokens.device)
            self.step_tokens.data = self.step_tokens.data.to(tokens.device)
        weight = copy_to_tp(self.weight, self.sp_group) if self.sp_group is not None else self.weight
        return torch.nn.functional.linear(tokens.to(self.dtype), weight.to(self.dtype))

    def count(self, tokens_per_expert: torch.Tensor) -> None:
        """A training micro-batch's routed tokens per expert, for the bias's next update."""
        if self.step_tokens is not None:
            self.step_tokens += tokens_per_expert

    @torch.no_grad()
    def update_expert_bias(self, rate: float, dp: CommGroup) -> None:
        """The bias after a step (Megatron's get_updated_expert_bias): + rate x sign(mean - tokens) per expert, the
        tokens summed over the step's micro-batches and the data-parallel ranks; the counts start again."""
        if self.expert_bias is None:
            return
        dp.all_reduce(self.step_tokens)
        counts = self.step_tokens.to(torch.float32)
        self.expert_bias += torch.sign(counts.mean() - counts) * rate
        self.step_tokens.zero_()


def expert_biases(model: nn.Module) -> dict[str, list[float]]:
    """{router name: its expert bias} of the model's routers that keep one (--moe-router-enable-expert-bias): a
    buffer, not a parameter, so the checkpoint's meta carries it (a few floats per layer)."""
    return {name: module.expert_bias.tolist() for name, module in model.named_modules()
            if isinstance(module, TopKRouter) and module.expert_bias is not None}


def restore_expert_biases(model: nn.Module, saved: dict[str, list[float]], directory: str) -> None:
    """Each router's expert bias from a checkpoint's `expert_biases`; one line when the checkpoint has none."""
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and module.expert_bias is not None:
            if name not in saved:
                raise ConfigError(f"{directory} holds no expert bias for {name} (saved without "
                                  f"--moe-router-enable-expert-bias?): load it with --finetune or drop the flag")
            module.expert_bias.copy_(torch.tensor(saved[name], dtype=torch.float32))
