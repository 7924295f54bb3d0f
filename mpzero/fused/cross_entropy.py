"""The vocab-parallel cross entropy's arithmetic on one chunk of logits z [c, V/tp] (the model's dtype), in two
implementations that `mpzero.tensor_parallel.vocab_parallel_linear_cross_entropy` runs between its all-reduces:

- "torch", the reference: one fp32 copy of the chunk's logits, worked on in place (mask the vocabulary padding,
  max; shift, exp, sum; in backward the same, divide, subtract the one-hot, scale). These are the tensors the
  activation formula and the planner's cross-entropy transient count.
- "compile" (`--cross-entropy-loss-fusion`, Megatron's flag; Megatron-core's native fusion is likewise its
  torch.compile'd jit_fuser over this arithmetic): the same arithmetic as pure functions under torch.compile,
  which reads z in the model's dtype and fuses each pass into one kernel (inductor: Triton on GPUs, C++ on CPUs).
  No fp32 copy of a chunk is made but the last chunk's exponentials, which forward keeps for backward as the
  reference does, so the saved bytes are the same. Each pass writes a new tensor beside its input: in bf16/fp16
  less than the reference's fp32 copy at the peak, in fp32 (where the reference works in place on the product
  itself) one chunk's logits more (the planner's cross-entropy transient counts both). Its sums run in another
  order: within 1e-6 of the reference (tests/fused/test_fused_cross_entropy.py).

At TP 1 nothing is all-reduced between the stages, and the whole forward of all the chunks (each chunk's product
with the output weight, both passes, the loss) is one call, `local_chunks`: for "compile" one compiled region
instead of three calls a chunk (a GPU step pays each call's guards and each op's launch on the host; GPT-2 124M at
micro-batch 8 has 4 chunks).

`first_padding`: this rank's first padding column (rows of W past the tokenizer's vocabulary), or the local
vocabulary size when it holds none; padding logits are -inf.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mpzero.fused.impl import compiled, resolve_impl


class CrossEntropyMath:
    """The reference: forward's stages (`start`, then `sums` after the max is all-reduced) and backward's
    gradient of the loss with respect to z, (softmax - onehot(target)) * grad_loss, in the model's dtype."""

    def start(self, z: torch.Tensor, first_padding: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(work, this rank's row max [c] fp32): `work` is what `sums` reads (here the fp32 masked logits)."""
        logits = _masked_fp32(z, first_padding)
        return logits, logits.amax(dim=-1)  # the values alone: max(dim) also finds the indices, 5x slower

    def sums(self, work: torch.Tensor, row_max: torch.Tensor, local_target: torch.Tensor, mine: torch.Tensor,
             first_padding: int, keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(target logit - max [c] (0 where another rank owns the target), sum of exp(z - max) [c], the fp32
        exponentials [c, V/tp] if `keep` else None), this rank's share of each."""
        logits = work.sub_(row_max.unsqueeze(-1))  # [c, V/tp], all <= 0
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp_logits = logits.exp_()
        return target_logit, exp_logits.sum(dim=-1), (exp_logits if keep else None)

    def local_chunks(self, hidden: torch.Tensor, weight: torch.Tensor, local_target: torch.Tensor,
                     mine: torch.Tensor, first_padding: int, chunk_size: int):
        """The whole forward where one rank holds the vocabulary (TP 1: nothing to all-reduce between the stages):
        `chunked_forward`'s result."""
        return chunked_forward(self, hidden, weight, local_target, mine, first_padding, chunk_size)

    def grad(self, z: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
             mine: torch.Tensor, grad_loss: torch.Tensor, first_padding: int) -> torch.Tensor:
        """d loss / d z from the recomputed logits z, in z's dtype."""
        dtype, logits = z.dtype, _masked_fp32(z, first_padding)
        del z  # a bf16 z is freed once copied (the caller's temporary): not held beside the fp32 softmax
        softmax = logits.sub_(row_max.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
        return _softmax_grad(softmax, local_target, mine, grad_loss, dtype)

    def grad_from_kept(self, kept: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
                       mine: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """d loss / d z from forward's kept exponentials, which it divides in place."""
        softmax = kept.div_(sum_exp.unsqueeze(-1))
        return _softmax_grad(softmax, local_target, mine, grad_loss, dtype)


def chunked_forward(math: CrossEntropyMath, hidden: torch.Tensor, weight: torch.Tensor, local_target: torch.Tensor,
                    mine: torch.Tensor, first_padding: int, chunk_size: int,
                    all_reduce_max: Callable[[torch.Tensor], object] | None = None,
                    all_reduce_sum: Callable[[torch.Tensor], object] | None = None):
    """The forward chunk by chunk of `chunk_size` tokens through `math`'s stages, from the hidden states [N, h] and
    this rank's output weight [V/tp, h]: (losses [N], row maxes [N], sums of exponentials [N], the last chunk's
    exponentials). With the vocabulary split across ranks, `all_reduce_max` and `all_reduce_sum` (in place) join
    each chunk's row max, then its target logit and sum, between the stages. Each chunk's logits are released
    before the next chunk's are made."""
    n, per_chunk = hidden.size(0), []
    for start in range(0, n, chunk_size):
        chunk = slice(start, start + chunk_size)
        work, row_max = math.start(F.linear(hidden[chunk], weight), first_padding)  # [c, V/tp] logits
        if all_reduce_max is not None:
            all_reduce_max(row_max)
        target_logit, sum_exp, kept = math.sums(work, row_max, local_target[chunk], mine[chunk], first_padding,
                                                start + chunk_size >= n)
        del work  # the last chunk's exponentials stay (kept)
        if all_reduce_sum is not None:
            all_reduce_sum(target_logit)
            all_reduce_sum(sum_exp)
        per_chunk.append((sum_exp.log() - target_logit, row_max, sum_exp))
    return (*(parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*per_chunk)), kept)


def _masked_fp32(z: torch.Tensor, first_padding: int) -> torch.Tensor:
    logits = z.float()  # z itself when fp32: a fresh product, worked on in place
    if first_padding < z.size(-1):
        logits[:, first_padding:] = float("-inf")
    return logits


def _softmax_grad(softmax, local_target, mine, grad_loss, dtype):
    # d loss / d z = softmax - onehot(target), the one-hot only on the rank that owns the target
    grad = softmax.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
    return grad.mul_(grad_loss.unsqueeze(-1)).to(dtype)


class FusedCrossEntropyMath(CrossEntropyMath):
    """The same stages as pure functions through torch.compile: z is read in its own dtype, nothing fp32 of a
    chunk's size is allocated but the kept exponentials, and the gradient is written once, in z's dtype."""

    def start(self, z, first_padding):
        return z, compiled(_fused_max)(z, first_padding)

    def sums(self, work, row_max, local_target, mine, first_padding, keep):
        if keep:
            return compiled(_fused_sums_kept)(work, row_max, local_target, mine, first_padding)
        return compiled(_fused_sums)(work, row_max, local_target, mine, first_padding) + (None,)

    def local_chunks(self, hidden, weight, local_target, mine, first_padding, chunk_size):
        """One compiled call (each chunk's product, both passes and loss) instead of three calls a chunk."""
        return compiled(_fused_local_chunks)(hidden, weight, local_target, mine, first_padding, chunk_size)

    def grad(self, z, row_max, sum_exp, local_target, mine, grad_loss, first_padding):
        return compiled(_fused_grad)(z, row_max, sum_exp, local_target, mine, grad_loss, first_padding)

    def grad_from_kept(self, kept, sum_exp, local_target, mine, grad_loss, dtype):
        return compiled(_fused_grad_from_kept)(kept, sum_exp, local_target, mine, grad_loss, dtype)


def _shifted(z, row_max, first_padding):
    """fp32 z - max, padding at -inf, as one expression the compiler fuses into its consumer."""
    logits = z.float()
    if first_padding < z.size(-1):
        columns = torch.arange(z.size(-1), device=z.device)
        logits = torch.where(columns < first_padding, logits, float("-inf"))
    return logits if row_max is None else logits - row_max.unsqueeze(-1)


def _fused_max(z, first_padding):
    return _shifted(z, None, first_padding).amax(dim=-1)


def _target_and_exp(z, row_max, local_target, mine, first_padding):
    logits = _shifted(z, row_max, first_padding)
    return logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0), logits.exp()


def _fused_sums(z, row_max, local_target, mine, first_padding):
    target_logit, exp_logits = _target_and_exp(z, row_max, local_target, mine, first_padding)
    return target_logit, exp_logits.sum(dim=-1)  # the exponentials stay inside the kernel


def _fused_sums_kept(z, row_max, local_target, mine, first_padding):
    target_logit, exp_logits = _target_and_exp(z, row_max, local_target, mine, first_padding)
    return target_logit, exp_logits.sum(dim=-1), exp_logits


def _fused_local_chunks(hidden, weight, local_target, mine, first_padding, chunk_size):
    """The chunks unrolled into one graph (a graph for each token count and chunk size); only the last chunk's
    exponentials leave it, the others' stay inside their kernels."""
    losses, maxes, sums = [], [], []
    for start in range(0, hidden.size(0), chunk_size):
        chunk = slice(start, start + chunk_size)
        z = F.linear(hidden[chunk], weight)
        row_max = _fused_max(z, first_padding)
        target_logit, exp_logits = _target_and_exp(z, row_max, local_target[chunk], mine[chunk], first_padding)
        sum_exp = exp_logits.sum(dim=-1)
        losses.append(sum_exp.log() - target_logit)
        maxes.append(row_max)
        sums.append(sum_exp)
    return torch.cat(losses), torch.cat(maxes), torch.cat(sums), exp_logits


def _fused_onehot_grad(softmax, local_target, mine, grad_loss, dtype):
    columns = torch.arange(softmax.size(-1), device=softmax.device)
    target = (columns == local_target.unsqueeze(-1)) & mine.unsqueeze(-1)
    return (torch.where(target, softmax - 1.0, softmax) * grad_loss.unsqueeze(-1)).to(dtype)


def _fused_grad(z, row_max, sum_exp, local_target, mine, grad_loss, first_padding):
    softmax = _shifted(z, row_max, first_padding).exp() / sum_exp.unsqueeze(-1)
    return _fused_onehot_grad(softmax, local_target, mine, grad_loss, z.dtype)


def _fused_grad_from_kept(kept, sum_exp, local_target, mine, grad_loss, dtype):
    return _fused_onehot_grad(kept / sum_exp.unsqueeze(-1), local_target, mine, grad_loss, dtype)


_MATH = {"torch": CrossEntropyMath(), "compile": FusedCrossEntropyMath()}


def cross_entropy_math(device: torch.device | str, impl: str = "auto") -> CrossEntropyMath:
    """The chunk arithmetic `impl` ("auto", "torch" or "compile") runs on `device`."""
    return _MATH[resolve_impl("cross_entropy", device, impl)]
