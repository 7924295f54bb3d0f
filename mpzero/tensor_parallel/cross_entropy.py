"""Cross entropy over logits whose vocabulary dimension is split across the TP group.

loss = log(sum_v exp(z_v - m)) - (z_target - m), m = max_v z_v. Three all-reduces of [tokens]-sized
tensors (max, target logit, sum of exponentials) replace gathering the [tokens, vocab] logits.
Computed in fp32 whatever the logits' dtype.

`vocab_parallel_linear_cross_entropy` fuses the output projection with it, chunk by chunk of tokens, so the
[tokens, V/tp] logits and their fp32 softmax are never held whole (`--cross-entropy-chunk-size`); the function
above is its reference, and stays the path without labels' logits (generation) and with chunk size 0. A chunk's
arithmetic between the all-reduces is `mpzero.fused.cross_entropy` (`--cross-entropy-loss-fusion` compiles it).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpzero.comm import CommGroup
from mpzero.fused import chunked_forward, cross_entropy_math
from mpzero.tensor_parallel.mappings import gather_sequence, reduce_scatter_sequence


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: CommGroup):
        ctx.dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.amax(dim=-1)  # the values alone: max(dim) also finds the indices, 5x slower
        group.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)  # [..., V/tp], all <= 0

        local_target, mine = _local_target(target, group.rank, logits.size(-1))
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


class _LinearCrossEntropy(torch.autograd.Function):
    """loss = vocab_parallel_cross_entropy(mask_padding(x W^T), target), chunk by chunk of tokens: a chunk's fp32
    logits [c, V/tp] live only inside its step. Forward keeps, per token, the all-reduced max and sum of
    exponentials (fp32), and the last chunk's exponentials themselves (the newest tensor when forward ends);
    backward takes that chunk first, releases its exponentials, then recomputes each other chunk's logits from the
    max and sum (one more x W^T: 2 c h V/tp FLOPs), and turns softmax - onehot, scaled by that token's incoming
    gradient, into dx and dW. A micro-batch of at most one chunk is never recomputed. Each token's loss gradient
    is its own (reduction "none"), so dW cannot be formed in forward as Liger-Kernel does for a mean."""

    @staticmethod
    def forward(ctx, x, weight, target, group, vocab_size, chunk_size, sequence_parallel, math):
        ctx.group, ctx.chunk_size, ctx.sequence_parallel, ctx.math = group, chunk_size, sequence_parallel, math
        hidden = _tokens(x, group, sequence_parallel)  # [N, h], the whole sequence
        local_target, mine = _local_target(target.reshape(-1), group.rank, weight.size(0))
        ctx.first_padding = first_padding = min(max(vocab_size - group.rank * weight.size(0), 0), weight.size(0))
        if group.size == 1:  # nothing to all-reduce between a chunk's stages: all the chunks in one call
            losses, maxes, sums, kept = math.local_chunks(hidden, weight, local_target, mine, first_padding,
                                                          chunk_size)
        else:
            losses, maxes, sums, kept = chunked_forward(
                math, hidden, weight, local_target, mine, first_padding, chunk_size,
                partial(group.all_reduce, op=dist.ReduceOp.MAX), group.all_reduce)
        ctx.save_for_backward(x, weight, local_target, mine, maxes, sums, kept)
        return losses.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        x, weight, local_target, mine, maxes, sums, kept = ctx.saved_tensors
        group, math = ctx.group, ctx.math
        hidden = _tokens(x, group, ctx.sequence_parallel)
        grad_loss = grad_loss.reshape(-1).float()
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)
        chunks = _chunks(hidden.size(0), ctx.chunk_size)
        for i, chunk in enumerate(chunks[-1:] + chunks[:-1]):  # the kept chunk first: freed before the others
            target, mine_chunk = local_target[chunk], mine[chunk]
            if i == 0 and kept.untyped_storage().nbytes():  # (a second backward, retain_graph, finds it freed)
                grad = math.grad_from_kept(_own_version(kept), sums[chunk], target, mine_chunk, grad_loss[chunk],
                                           hidden.dtype)
            else:
                grad = math.grad(F.linear(hidden[chunk], weight), maxes[chunk], sums[chunk], target, mine_chunk,
                                 grad_loss[chunk], ctx.first_padding)  # [c, V/tp] in the model's dtype
            torch.mm(grad, weight, out=grad_hidden[chunk])
            if i == 0:  # dW [V/tp, h] summed in place, chunk by chunk (one rounding each in bf16)
                torch.mm(grad.t(), hidden[chunk], out=grad_weight)
                kept.untyped_storage().resize_(0)  # autograd holds the saved tensor until backward returns
            else:
                # addmm_'s own kernel (addmm_out into self), spelled so FlopCounterMode counts it: it has no addmm_
                torch.addmm(grad_weight, grad.t(), hidden[chunk], out=grad_weight)
            del grad
        grad_hidden = grad_hidden.view(*x.shape[:-2], -1, x.size(-1))
        if ctx.sequence_parallel:
            grad_x = reduce_scatter_sequence(grad_hidden, group)
        else:
            grad_x = grad_hidden
            group.all_reduce(grad_x)  # the input was replicated across the TP group (copy_to_tp's backward)
        return grad_x, grad_weight, None, None, None, None, None, None


def _own_version(saved: torch.Tensor) -> torch.Tensor:
    """A tensor on `saved`'s memory with a version counter of its own: worked on in place (no second copy at the
    peak) without tripping autograd's check that the saved tensor is unchanged, should a second backward
    (retain_graph) unpack it; that one finds the memory released (resized to 0 after use) and recomputes."""
    return torch.empty(0, dtype=saved.dtype, device=saved.device).set_(
        saved.untyped_storage(), saved.storage_offset(), saved.shape, saved.stride())


def _tokens(x: torch.Tensor, group: CommGroup, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, h] (or this rank's sequence slice [b, s/tp, h], gathered) as [b*s, h]."""
    if sequence_parallel:
        x = gather_sequence(x, group)
    return x.reshape(-1, x.size(-1))


def _local_target(target: torch.Tensor, rank: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids in this rank's vocabulary shard (0 where another rank owns them) and which ones it owns."""
    local_target = target - rank * local_vocab
    mine = (local_target >= 0) & (local_target < local_vocab)
    return local_target.masked_fill(~mine, 0), mine


def _chunks(n: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        group: CommGroup, vocab_size: int, chunk_size: int,
                                        sequence_parallel: bool = False, impl: str = "auto") -> torch.Tensor:
    """Per-token loss [b, s] of the output projection x W^T and vocab_parallel_cross_entropy, fused, `chunk_size`
    tokens at a time, without ever holding the [b, s, V/tp] logits. x [b, s, h] is replicated across the TP group
    (its gradient all-reduced), or with `sequence_parallel` this rank's slice [b, s/tp, h] (gathered, its gradient
    reduce-scattered); W [V/tp, h] is this rank's vocabulary shard, its rows from `vocab_size` on padding (-inf).
    `impl`: a chunk's arithmetic (`mpzero.fused.cross_entropy_math`: "torch", "compile" or the device's "auto")."""
    if chunk_size < 1:
        raise ValueError(f"chunk size {chunk_size} must be positive")
    return _LinearCrossEntropy.apply(x, weight, target, group, vocab_size, chunk_size,
                                     sequence_parallel and group.size > 1, cross_entropy_math(x.device, impl))
