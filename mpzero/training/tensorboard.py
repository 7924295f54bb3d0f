"""TensorBoard scalars, written by the logging rank only; on other ranks every call is a no-op.
Tags are Megatron's (`lm loss`, `learning-rate`, `grad-norm`, ...); the x-axis is the iteration."""

from __future__ import annotations


class TensorBoardLogger:
    def __init__(self, log_dir: str | None, is_logging_rank: bool):
        self.writer = None
        if log_dir and is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter  # tensorboard is imported only when used
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=100)

    def scalars(self, values: dict[str, float], iteration: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
