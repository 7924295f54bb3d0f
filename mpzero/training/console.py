"""Megatron's console lines, so users' log parsers carry over."""

from __future__ import annotations

import math


def iteration_line(iteration: int, train_iters: int, consumed: int, elapsed_ms: float, lr: float,
                   global_batch: int, loss: float, loss_scale: float, grad_norm: float, skipped: int, nan: int,
                   extra: dict[str, str] | None = None) -> str:
    fields = [f" iteration {iteration:8d}/{train_iters:8d}",
              f"consumed samples: {consumed:12d}",
              f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
              f"learning rate: {lr:.6E}",
              f"global batch size: {global_batch:5d}",
              f"lm loss: {loss:.6E}",
              f"loss scale: {loss_scale:.1f}",
              f"grad norm: {grad_norm:.3f}",
              f"number of skipped iterations: {skipped:3d}",
              f"number of nan iterations: {nan:3d}"]
    fields += [f"{name}: {value}" for name, value in (extra or {}).items()]
    return " | ".join(fields) + " |"


def model_flops_per_iteration(num_layers: int, hidden: int, seq: int, vocab: int, global_batch: int,
                              recompute: bool) -> float:
    """Narayanan et al. (2021): 72 B s l h^2 (1 + s/(6h) + V/(16 l h)) for forward + backward, 96 with
    full recomputation (one more forward). The figure Megatron divides by time for TFLOP/s."""
    passes = 96 if recompute else 72
    return passes * global_batch * seq * num_layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * num_layers * hidden))


def validation_line(where: str, loss: float) -> str:
    """`where`: "iteration 100", or "the end of training for val data" / "... for test data"."""
    return f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))  # Megatron caps the exponent so a diverged run still prints
