"""Cross entropy over logits whose vocabulary dimension is split across the TP group.

loss = log(sum_v exp(z_v - m)) - (z_target - m), m = max_v z_v. Three all-reduces of [tokens]-sized
tensors (max, target logit, sum of exponentials) replace gathering the [tokens, vocab] logits.
Computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpzero.comm import CommGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: CommGroup):
        ctx.dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        group.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)  # [..., V/tp], all <= 0

        local_vocab = logits.size(-1)
        local_target = target - group.rank * local_vocab
        mine = (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~mine, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        group.all_reduce(target_logit)

        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        group.all_reduce(sum_exp)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, mine = ctx.saved_tensors
        # d loss / d z = softmax - onehot(target), the one-hot only on the rank that owns the target
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Per-token loss [...] from this rank's logits [..., V/tp] and global target ids [...]."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
