"""The training loop's reads of the device when its steps are launched without a host synchronisation (issue 46).

Each iteration's step is launched (`ZeroOptimizer.launch_step`) without reading the device; its loss, gradient norm
and SIGTERM flag stay there as device scalars (`LaunchedSteps.add`) until the loop next needs the host: at a log
line, before an evaluation, a checkpoint or --exit-interval's stop, and at the last iteration (`must_read`). Then
they are read, every iteration's at once, in one copy (`LaunchedSteps.read`), and recorded as the synchronising
loop records them. What changes is when the host learns them:
- --check-for-nan-in-loss-and-grad: a non-finite loss or gradient norm skips the update on the device (and every
  one after it); the run stops at the next read, naming the iteration it happened at, with the parameters and the
  last checkpoint those before it (a checkpoint is always preceded by a read);
- SIGTERM is acted on at the next read: at most --log-interval iterations later (give a scheduler's grace period
  room for that, or use --sync-every-iteration, which reads every iteration as before);
- fp16: the loss scaler is on the device (zero/device_scaler.py); which iterations overflowed and were skipped, their
  loss scales and learning rates are read at the next read, with the scaler's state (`mpzero.zero.settle`); the
  stop after as many overflows in a row at the minimum scale as the synchronising step allows comes at that read too.
  Each launch gets the learning rates of every count of skipped steps it may follow (`lrs`); the device picks one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from mpzero.errors import TrainingError
from mpzero.moe import moe_metrics
from mpzero.training.config import RunConfig
from mpzero.zero import DeviceStep, StepStats, read_to_host, settle, settle_values


@dataclass(frozen=True)
class _Launched:
    iteration: int
    lrs: list[float]  # the learning rate if k of the steps launched since the last read were skipped (fp16)
    loss_sum: torch.Tensor  # the global batch's loss times the DP size
    step: DeviceStep
    terminated: torch.Tensor  # SIGTERM on some rank, all-reduced
    loss_scale: float
    cp_bytes: float = 0.0  # sent on the CP group by this iteration's passes


def launched_steps(run: RunConfig, optimizer) -> LaunchedSteps | None:
    """Where the optimizer's step runs on the device (`ZeroOptimizer.steps_on_device`) and --sync-every-iteration is
    not given: the steps are launched with no host synchronisation, and read at the loop's decisions."""
    if run.training.sync_every_iteration or not optimizer.steps_on_device:
        return None
    if optimizer.precision.dtype == "fp16" and moe_metrics(optimizer.model) is not None:
        return None  # the MoE losses' backward scale is the host's loss scale (moe/report.py)
    return LaunchedSteps(optimizer.groups.world.rank, optimizer.groups.dp_cp.size, run.training.check_for_nan)


def must_read(run: RunConfig, iteration: int) -> bool:
    """Whether the loop reads the launched steps after `iteration`: a log line, an evaluation, a checkpoint
    interval, --exit-interval, or the last iteration. (The train() loop's decisions that need them.)"""
    evaluating = run.evaluation.eval_interval if run.evaluation.eval_iters else None
    intervals = (run.logging.log_interval, evaluating, run.checkpoint.save_interval, run.training.exit_interval)
    return iteration == run.training.train_iters or any(n and iteration % n == 0 for n in intervals)


class LaunchedSteps:
    """The steps launched since the last read, and their reading."""

    def __init__(self, rank: int, dp_size: int, check_loss: bool):
        """`dp_size`: the ranks whose losses the loss sums (data- and context-parallel)."""
        self.rank, self.dp_size, self.check_loss = rank, dp_size, check_loss
        self._pending: list[_Launched] = []
        self.optimizer = None  # the one launching, whose fp16 scaler each read settles

    def launch(self, optimizer, iteration: int, lrs: list[float], loss_sum: torch.Tensor, terminated: torch.Tensor,
               cp_bytes: float = 0.0) -> None:
        """`optimizer.launch_step(lrs)` of `iteration` (watching the loss where --check-for-nan-in-loss-and-grad),
        its results kept for the next read. `lrs[k]`: the learning rate if k of the launched steps not yet read
        were skipped (bf16 and fp32 never skip: only lrs[0] is used)."""
        self.optimizer = optimizer
        step = optimizer.launch_step(lrs, watch=(loss_sum,) if self.check_loss else ())
        self._pending.append(_Launched(iteration, lrs, loss_sum, step, terminated, optimizer.loss_scale, cp_bytes))

    def results_after(self, run: RunConfig, iteration: int, result: Callable) -> list:
        """`read(result)` when the loop needs the host after `iteration` (`must_read`), else nothing yet."""
        return self.read(result) if must_read(run, iteration) else []

    def read(self, result: Callable[[float, float, StepStats, bool, float], object]) -> list:
        """Every pending step's `result(loss, lr, stats, terminated, cp_bytes)` in order, from one copy to the host; a
        TrainingError for the first non-finite value the device skipped an update for."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        halted, settling = pending[-1].step.halted, settle_values(self.optimizer)
        values = [v for p in pending for v in _per_step(p)]
        host = read_to_host(values + settling + ([halted] if halted is not None else []))
        width = len(values) // len(pending)
        steps = [_read_step(p, host[width * i:width * (i + 1)], self.dp_size) for i, p in enumerate(pending)]
        if halted is not None and host[-1]:
            self._stop(pending, steps, pending[-1].iteration)
        settle(self.optimizer, host[len(values):len(values) + len(settling)])
        return [result(loss, lr, stats, terminated, p.cp_bytes)
                for p, (loss, lr, stats, terminated) in zip(pending, steps)]

    def _stop(self, pending: list[_Launched], steps: list[tuple], read_at: int) -> None:
        for p, (loss, _, stats, _) in zip(pending, steps):
            norm = stats.grad_norm
            what = (f"lm loss is {loss}" if self.check_loss and not math.isfinite(loss) else
                    f"the gradient norm is {norm}" if norm is not None and not math.isfinite(norm) else None)
            if what is None:
                continue
            where = f"at iteration {p.iteration} (rank {self.rank})"
            if p.iteration == read_at:
                raise TrainingError(f"{what} {where}: stopped before the update, so the parameters and the last "
                                    f"checkpoint are intact; lower --lr or enable --clip-grad")
            raise TrainingError(f"{what} {where}, read at iteration {read_at}: its update and the "
                                f"{read_at - p.iteration} after it were skipped on the device (stopped before the "
                                f"update), so the parameters are those before iteration {p.iteration} and the last "
                                f"checkpoint is intact; lower --lr or enable --clip-grad")
        raise TrainingError(f"a launched step was skipped for a non-finite value before iteration "
                            f"{pending[0].iteration} (rank {self.rank}): stopped")


def _per_step(p: _Launched) -> list[torch.Tensor]:
    """What is read of one launched step: the loss, the squared norm, SIGTERM's flag (fp16: the overflow flag, the
    loss scale and the skipped count the learning rate was picked by)."""
    fp16 = [] if p.step.found_inf is None else [p.step.found_inf, p.step.loss_scale, p.step.skipped_before]
    return [p.loss_sum, p.step.squared_norm, p.terminated] + fp16


def _read_step(p: _Launched, host: list[float], dp_size: int) -> tuple[float, float, StepStats, bool]:
    """(loss, learning rate, StepStats, SIGTERM) of one launched step from its values read (`_per_step`)."""
    loss, squared, terminated, *fp16 = host
    if not fp16:
        return loss / dp_size, p.lrs[0], StepStats(math.sqrt(squared), False, p.loss_scale), bool(terminated)
    skipped, scale, skipped_before = bool(fp16[0]), fp16[1], int(fp16[2])
    stats = StepStats(None if skipped else math.sqrt(squared), skipped, scale)
    return loss / dp_size, p.lrs[skipped_before], stats, bool(terminated)
