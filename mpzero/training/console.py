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


def validation_line(where: str, loss: float) -> str:
    """`where`: "iteration 100", or "the end of training for val data" / "... for test data"."""
    return f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))  # Megatron caps the exponent so a diverged run still prints
