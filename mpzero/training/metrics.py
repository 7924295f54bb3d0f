"""The run's scalars, to TensorBoard (`--tensorboard-dir`) and Weights & Biases (`--wandb-project`), written by
the logging rank only; on other ranks, and with neither flag, every call is a no-op. One `scalars()` call feeds
every sink, so both see the same tags (Megatron's: `lm loss`, `learning-rate`, `grad-norm`, ...) at the same
iterations (TensorBoard's step, wandb's `step`).

wandb is an optional package (`pip install -e '.[wandb]'`): the flags check it is importable at start
(mpzero/cli/arguments.py); it is imported here only when used. `WANDB_MODE=offline` keeps everything on the machine
(`wandb sync DIR` uploads it later). The run's resolved flags are its wandb config.
"""

from __future__ import annotations

from mpzero.files import random_suffix
from mpzero.training.config import LoggingConfig


class TensorBoardSink:
    """TensorBoard's event file, which its writer opens by name itself: the name ends in 64 random bits
    (files.random_suffix), so nobody can plant a link where it will be written (TensorBoard reads any file
    whose name holds `tfevents`)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # tensorboard is imported only when used
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=100,
                                    filename_suffix=random_suffix())

    def scalars(self, values: dict[str, float], iteration: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, iteration)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run: Megatron's --wandb-project, --wandb-exp-name, --wandb-save-dir (files go under
    SAVE_DIR/wandb), --wandb-entity."""

    def __init__(self, logging: LoggingConfig, config: dict):
        import wandb
        self.run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name,
                              entity=logging.wandb_entity, dir=logging.wandb_save_dir, config=config)

    def scalars(self, values: dict[str, float], iteration: int) -> None:
        self.run.log(values, step=iteration)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    def __init__(self, logging: LoggingConfig, is_logging_rank: bool, config: dict | None = None):
        self.sinks = []
        if is_logging_rank and logging.tensorboard_dir:
            self.sinks.append(TensorBoardSink(logging.tensorboard_dir))
        if is_logging_rank and logging.wandb_project:
            self.sinks.append(WandbSink(logging, config or {}))

    def scalars(self, values: dict[str, float], iteration: int) -> None:
        for sink in self.sinks:
            sink.scalars(values, iteration)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
