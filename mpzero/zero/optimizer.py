"""The ZeRO optimizer front: one object the training loop drives, whatever the stage.

    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=2), OptimizerConfig(lr=3e-4), PrecisionConfig("bf16"))
    for micro_batch in range(m):
        loss = model(tokens, labels).mean() / m          # the caller divides by the micro-batches
        opt.backward(loss, last_micro_batch=(micro_batch == m - 1))
    stats = opt.step(lr)                                # StepStats(grad_norm, skipped, loss_scale)

A pipeline stage without the loss runs its backward from the next stage's gradient inside the same window:

    with opt.backward_window(last_micro_batch) as scale:  # the loss scale the last stage multiplied its loss by
        torch.autograd.backward(output, grad_from_next_stage)

Three owners, one job each, behind explicit contracts:
- the stage (`stage_base.ZeroStage`: stages.py, stage3.py) owns parameter storage and gradient buffers,
  and spreads updated parameter slices to the model;
- the master store (`masters.MasterStore`) owns the fp32 master slices and the update rule's states (the
  rule is a value, `OptimizerConfig.rule`: AdamW, SGD), runs the rule and is the only writer of parameter values;
- this front owns the loss scaler, the global norm and clipping, and accounting (`reports.py`).
A step: gradients (averaged over DP, reduced by the stage) are unscaled to fp32; the global norm is summed on
the device (fp16: with the overflow check folded in) and read to the host in the step's one synchronisation,
with any scalars of the caller's (`check_gradients`); fp16 overflow on any rank skips the step everywhere,
else the step clips by the norm; the store updates its masters and writes
the parameter slices; the stage spreads them (all-gathers them, stages 1-2). `launch_step` is the same update with
no synchronisation at all (device_step.py: the norm, the coefficient and the non-finite check stay on the device).
Gradient buffers are zeroed by `step()`; `zero_grad()` discards gradients without stepping.
Every trainable parameter must say how it is split across TP (`mpzero.tensor_parallel.placement`): the norm
and checkpoints depend on it, so an unmarked one is refused here, at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpzero.deferred_init import is_deferred
from mpzero.errors import ConfigError, TrainingError
from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel import is_pipeline_tied, placements
from mpzero.zero.config import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.delayed import DelayedUpdate
from mpzero.zero.families import (families_by_bucket, families_working_set, family_stages, make_stage,
                                  parameter_families)
from mpzero.zero.device_scaler import scaled_loss
from mpzero.zero.device_step import DeviceStep, launch, steps_on_device
from mpzero.zero.flat import DecayRule, mark_weight_decay
from mpzero.zero.masters import DeviceMasters, MasterStore, OwnedPiece
from mpzero.zero.norm import (ArrivingNorm, clip_coefficient, grad_norm_squared, norm_runs, read_to_host,
                              scale_grads_)
from mpzero.zero.reports import OptimizerReports
from mpzero.zero.step_grads import FileGrads, Fp32Buckets
from mpzero.zero.scaler import make_loss_scaler
from mpzero.zero.state import consolidated_weights

if TYPE_CHECKING:
    from mpzero.zero.offload import OffloadDirectory


@dataclass(frozen=True)
class StepStats:
    grad_norm: float | None  # global norm before clipping; None when the step was skipped
    skipped: bool  # fp16 overflow somewhere: nothing was updated
    loss_scale: float  # the scale this iteration's backward used


@dataclass(frozen=True)
class GradientCheck:
    """What a step reads from the device, in one copy (`ZeroOptimizer.check_gradients`)."""
    norm: float  # global norm before clipping; inf or nan when any rank's gradients overflowed
    read_with: tuple[float, ...]  # the caller's scalars, in the order given


class ZeroOptimizer(OptimizerReports):
    """An elementwise update rule (`optimizer.rule`: AdamW, SGD) over `model`'s trainable parameters,
    partitioned across `groups.dp_cp` (DP x CP: `self.groups.dp` below; `groups.dp` at CP 1) by `zero.stage`.

    Managed parameters are cast to `precision.dtype` and become views of flat buffers (stage 3:
    released between uses); cast the rest of the model (frozen parameters, buffers) yourself.
    `units` (stage 3 only): the modules gathered one at a time; default `default_units(model)`.
    `decay`: which parameters weight decay applies to: a function (name, parameter) -> bool,
    or a set of parameter names; default Megatron's rule (parameters with ndim >= 2, not biases or LayerNorm).
    `offload`: where the optimizer state (stages 1-3) and stage 3's parameter shards live (host memory or
    disk, `mpzero.zero.offload`); the training result is the same bit for bit. Call `close()` when done with an
    offloaded optimizer (files and I/O threads).
    """

    def __init__(self, model: nn.Module, groups: ParallelGroups, zero: ZeroConfig, optimizer: OptimizerConfig,
                 precision: PrecisionConfig, units: list[nn.Module] | None = None,
                 decay: DecayRule | Collection[str] | None = None, offload: OffloadConfig | None = None):
        offload = offload or OffloadConfig()
        for section in (zero, optimizer, precision):
            section.validate()
        offload.validate(zero.stage)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
        groups = dataclasses.replace(groups, dp=groups.dp_cp)  # parameters replicated over CP: reduced over DP x CP
        self.model, self.groups, self.zero, self.config, self.precision = model, groups, zero, optimizer, precision
        self.rule = optimizer.rule
        self.offload = offload
        self.placements = placements(named)  # refuses a parameter that does not say how TP splits it
        self.decays = mark_weight_decay(named, decay)  # {name: decays}, recorded for the stage's layouts
        self.numel = sum(p.numel() for _, p in named)
        self.offload_directory = None
        if offload.uses_disk:  # the tiers load with the runs that use them
            from mpzero.zero.offload import open_offload_directory
            self.offload_directory = open_offload_directory(
                offload, zero.stage, groups.world, groups.dp_size, self.numel, precision.torch_dtype.itemsize,
                precision.grad_dtype.itemsize, self.rule.state_bytes_per_param)
        self.stage = self.masters = self._delayed = None
        self._closed = False
        try:
            self.stage = make_stage(model, named, groups, zero, precision, units, offload, self.offload_directory)
            stages = family_stages(self.stage)  # before anything is made
            self._construction_formula = families_working_set(
                [s.layouts for s in stages], [s.gathers for s in stages], zero.stage, precision.torch_dtype.itemsize,
                precision.dtype != "fp32", offload.params != "none")
            self.masters = self._make_masters(offload, self.offload_directory)
        except BaseException:  # e.g. a full disk: no file or folder of this run stays behind
            self.close()
            raise
        self.scaler = make_loss_scaler(precision)
        self._device_scaler = None  # fp16's launched steps: the scaler on the device, from the first launch on
        self.unsettled_steps = 0  # fp16's launched steps since the host last learned which were skipped (`settle`)
        self.stage.write_gradients_together(set(getattr(model, "compiled_backward_parameters", lambda: ())()))
        self._delayed = None if offload.delayed_update_after is None else DelayedUpdate(self.masters, self.stage)
        self.families = parameter_families(named, groups)  # dense over DP x CP; expert over expert-DP
        by_bucket = families_by_bucket(self.stage, self.families)
        self._bucket_groups = [family.group for family in by_bucket]
        self._norm_runs = norm_runs(self.stage.layouts, self.placements, groups.tp_rank, groups.dp_rank,
                                    [(family.tp.rank, family.group.rank) for family in by_bucket])
        self._tied_buckets = [b for b, layout in enumerate(self.stage.layouts)
                              if any(is_pipeline_tied(param) for param in layout.params)]
        if self._tied_buckets and self.stage.gradient_file is not None:
            self.close()
            raise ConfigError("the output layer tied to the embedding across pipeline stages adds the two stages' "
                              "gradients before the step, and --offload-optimizer disk at --zero-stage 2 keeps "
                              "them on disk: use --untie-embeddings-and-output-weights, --offload-optimizer cpu or "
                              "--zero-stage 1")
        self._arriving = None  # gradients on disk: the norm is taken as their final slices arrive in backward
        if self.stage.gradient_file is not None:
            self._arriving = ArrivingNorm(self._norm_runs, len(self.stage.layouts), precision.dtype == "fp16")
            self.stage.watch_final_gradients(self._final_gradients)
        self.lr, self.iteration = optimizer.lr, 0
        self._micro_batches, self._last_micro_batches, self._reduced = 0, 1, False
        self._checked = None  # (unscaled fp32 gradients, GradientCheck) between check_gradients() and step()
        self._halted = None  # launch_step: a device flag, set for good once a launched step met a non-finite value
        self.step_fp32_peak = 0  # the most fp32 gradient bytes a step held at once (low-precision gradients)
        self._start_counting()

    def _make_masters(self, offload: OffloadConfig, directory: OffloadDirectory | None) -> MasterStore:
        """The master store, taking the stage's starting values one bucket at a time as the stage makes them
        (construction.py): no rank ever holds its whole fp32 model."""
        initial = self.stage.initial_master_slices()
        if offload.optimizer == "none":
            masters = DeviceMasters(self.stage.layouts, self.stage.param_shards, initial, self.config)
        else:
            from mpzero.zero.offload import OffloadedMasters  # host/disk tiers: only runs that ask for them
            # The run's device, also when the gradients are streamed to the host in backward (stages 2-3): on a GPU
            # the updated parameters go up through pinned staging (it was taken from the gradients' device, the
            # host then, which left that staging pageable and its copies synchronous).
            masters = OffloadedMasters(self.stage.layouts, self.stage.param_sink(), initial, self.config, offload,
                                       directory, self.stage.device,
                                       staged_grads=not offload.streams_grads(self.zero.stage))
        initial.finish()
        unmade = [name for name, param in self.model.named_parameters() if is_deferred(param)]
        if unmade:
            raise ConfigError(f"parameter {unmade[0]!r} was built without storage (a deferred parameter) and is not "
                              f"trained, so ZeroOptimizer does not make it: make it yourself "
                              f"(mpzero.deferred_init.materialize_module) or build the model on a device")
        return masters

    def close(self) -> None:
        """Release the offload tiers' files and threads, then their folder and its lock (a no-op in memory)."""
        if self._closed:
            return
        self._closed = True  # once: the reports stay readable after close
        if self._delayed is not None and self._delayed.pending:
            self._delayed._thread.join()  # its result is dropped: the state's files and threads go next
        for holder in (self.masters, self.stage, self.offload_directory):
            if holder is not None:
                holder.close()

    def check_files(self) -> None:
        """A TrainingError (one line) when an offload file was deleted or cut short by someone else (before a
        checkpoint reads the state from them)."""
        for holder in (self.masters, self.stage):
            holder.check_files()

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def zero_grad(self) -> None:
        self.stage.zero_grad()
        if self._arriving is not None:
            self._arriving.reset()
        self._micro_batches, self._reduced, self._checked = 0, False, None

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Backward of one micro-batch's loss (already divided by the number of micro-batches).
        Stages 0-1 communicate only when `last_micro_batch`; stages 2-3 reduce every micro-batch."""
        with self.backward_window(last_micro_batch) as scale:
            scaled_loss(loss, scale).backward()

    @contextlib.contextmanager
    def backward_window(self, last_micro_batch: bool, micro_batch: bool = True):
        """The gradients a backward produces inside are collected (and reduced as `backward` does); yields the
        loss scale (fp16's dynamic scale, else 1), which the loss must be multiplied by. A pipeline stage runs its
        backward from the next stage's (already scaled) gradient here. `micro_batch` False: the window adds to the
        micro-batch before it (zero bubble's weight-gradient pass), not counted as one more."""
        self.stage.begin_backward(last_micro_batch)
        yield self.scaler.scale if self._device_scaler is None else self._device_scaler.loss_scale(torch.float32)
        self.stage.end_backward()
        self._micro_batches += micro_batch
        self._reduced = last_micro_batch

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def tied_gradient_bytes(self) -> int:
        """This rank's gradient slices of parameters tied across pipeline stages (all-reduced with the other
        stage's once per step)."""
        g = self.precision.grad_dtype.itemsize
        return sum(self.stage.layouts[b].shard_numel * g for b in self._tied_buckets)

    def _add_tied_gradients(self) -> None:
        """A parameter tied across pipeline stages (its bucket alone, partitioned alike on both): each stage's
        reduced slice becomes the sum of both stages' (Megatron's embedding-group all-reduce), so both copies
        take the same update."""
        for bucket in self._tied_buckets:
            shard = self.stage.grad_shards[bucket]
            on_device = shard if shard.device == self.groups.device else shard.to(self.groups.device)
            self.groups.embedding.all_reduce(on_device)
            if on_device is not shard:  # gradients streamed to host memory (an offloaded optimizer)
                shard.copy_(on_device)

    def check_gradients(self, read_with: tuple[torch.Tensor, ...] = ()) -> GradientCheck:
        """The step's one device-to-host synchronisation, before anything is updated: unscales the gradients and
        reads the global norm (fp16: with the overflow check folded in) together with the caller's own device
        scalars `read_with` (the training loop's loss and stop flag), in one copy. `step()` then uses it;
        calling `step()` alone does both."""
        self._check_reduced()
        if self._checked is not None:
            raise RuntimeError("check_gradients() runs once per step: its gradients are already unscaled")
        self._add_tied_gradients()
        grads = self._fp32_grads()
        cast = isinstance(grads, Fp32Buckets)  # the norm then reads the low-precision shards themselves
        if isinstance(grads, FileGrads):  # on disk: summed as they arrived
            squared = self._arriving.squared(self.groups)
        else:
            squared = grad_norm_squared(grads.shards if cast else grads, self._norm_runs, self.groups,
                                        check_overflow=self.precision.dtype == "fp16",
                                        scale=grads.inverse_scale if cast else 1.0)
        host = read_to_host([squared, *read_with])
        self._checked = grads, GradientCheck(math.sqrt(host[0]), tuple(host[1:]))
        return self._checked[1]

    def _check_reduced(self) -> None:
        if not self._reduced:
            raise RuntimeError("step() needs backward(loss, last_micro_batch=True) first: the gradients of "
                               "this global batch have not been reduced across data-parallel ranks")

    @property
    def steps_on_device(self) -> bool:
        """Whether `launch_step` can update without reading the device (device_step.py: not fp16, not offloaded,
        an update rule that skips on a device flag)."""
        return steps_on_device(self)

    def launch_step(self, lr: float | list[float] | None = None, watch: tuple[torch.Tensor, ...] = ()) -> DeviceStep:
        """The step with no host synchronisation (device_step.py): the norm, the clipping coefficient and the
        non-finite check stay on the device; nothing is updated once the norm or a `watch` value (device scalars,
        e.g. the loss) was non-finite (with check_for_nan_in_grad). Returns what the caller reads later.
        fp16: an overflow skips the update on the device; `lr` may be a list, `lr[k]` the learning rate if k of the
        `unsettled_steps` launched since the last `settle` were skipped (a float: the same for every k); the caller
        reads `device_step.settle_values` and hands them to `device_step.settle` before it checkpoints or steps
        synchronously."""
        self._check_reduced()
        if not self.steps_on_device:
            raise RuntimeError("launch_step() needs a step that runs on the device: an offloaded optimizer and "
                               "rules that cannot skip on a device flag read the norm first: call step()")
        launched = launch(self, lr, watch)
        self._last_micro_batches = self._micro_batches
        self.iteration += 1
        self.zero_grad()
        return launched

    def step(self, lr: float | None = None) -> StepStats:
        if self.unsettled_steps:
            raise RuntimeError("step() after launched fp16 steps: settle() them first (the scaler is on the device)")
        if self._checked is None:
            self.check_gradients()
        grads, check = self._checked
        if lr is not None:
            self.lr = lr
        scale, norm = self.scaler.scale, check.norm
        skipped = self.precision.dtype == "fp16" and not math.isfinite(norm)  # an overflow on some rank
        if not skipped:
            if not math.isfinite(norm) and self.zero.check_for_nan_in_grad:
                raise TrainingError(f"the gradient norm is {norm} at iteration {self.iteration + 1} (rank "
                                    f"{self.groups.world.rank}): stopped before the update, so the parameters and "
                                    f"the last checkpoint are intact; lower --lr or enable --clip-grad")
            coef = clip_coefficient(norm, self.config.clip_grad)
            if self._delayed is not None and self.iteration >= self.offload.delayed_update_after:
                scale_grads_(grads, coef)  # clipped before the snapshot the background step reads
                self.finish_update()  # the previous iteration's update reaches the model now
                self._delayed.start(grads, self.lr)  # this one's runs while the next forward/backward do
            else:
                self.masters.step(grads, self.lr, grad_scale=coef)
                if isinstance(grads, Fp32Buckets):  # the fp32 copies go; their high-water mark stays for the report
                    grads.release()
                    self.step_fp32_peak = max(self.step_fp32_peak, grads.meter.peak)
                self.stage.after_update()
        else:
            self.finish_update()
        self.scaler.update(skipped)
        if self.scaler.skips_at_min_scale >= self.precision.max_skips_at_min_scale:
            raise TrainingError(f"fp16 gradients overflowed at the minimum loss scale {self.scaler.scale:g} for "
                                f"{self.scaler.skips_at_min_scale} iterations in a row (iteration "
                                f"{self.iteration + 1}): nothing is being learned; train in bf16, lower --lr, or "
                                f"lower --min-loss-scale")
        self._last_micro_batches = self._micro_batches
        self.iteration += 1
        self.zero_grad()
        return StepStats(None if skipped else norm, skipped, scale)

    def _final_gradients(self, bucket: int, values: torch.Tensor) -> None:
        """A bucket's final gradient slice on its way to disk: its share of the norm, unscaled as the step will
        (the loss scale changes only after the step)."""
        self._arriving.add(bucket, values, 1.0 / self.scaler.scale)

    def finish_update(self) -> None:
        """With --offload-delayed-update-after: apply the pending update now (before a checkpoint, an evaluation,
        the end of training); a no-op otherwise. Every rank calls it (the stage spreads the parameters over DP).
        See delayed.py."""
        if self._delayed is not None:
            self._delayed.finish()
            self.step_fp32_peak = max(self.step_fp32_peak, self._delayed.fp32_peak)

    def _fp32_grads(self, inverse: float | torch.Tensor | None = None) -> list[torch.Tensor] | Fp32Buckets:
        """This rank's gradient slices in fp32, divided by the loss scale: fp32 buffers in place (they are zeroed
        after the step anyway); low-precision ones as `Fp32Buckets`, cast as the step reads them: a bucket at a
        time in memory, a sub-group at a time by an offloaded optimizer (see step_grads.py). `inverse`: 1 / the
        scale (fp16's launched step: a device tensor); default the host scaler's."""
        inverse = 1.0 / self.scaler.scale if inverse is None else inverse
        if self.stage.gradient_file is not None:
            return FileGrads(self.stage.gradient_file, inverse)
        shards = self.stage.grad_shards
        if any(grad.dtype != torch.float32 for grad in shards):
            return Fp32Buckets(shards, inverse)
        scaled = isinstance(inverse, torch.Tensor) or inverse != 1.0  # a tensor is not read
        return [grad.mul_(inverse) if scaled else grad for grad in shards]

    # -- export and checkpoint (collectives over DP, left out of the communication report) -------
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights of this TP rank's model, keyed by parameter name, on every DP rank."""
        self.finish_update()
        return self.uncounted(consolidated_weights, self.model, self.stage.layouts, self.masters.masters(),
                              self._bucket_groups)

    def owned_pieces(self) -> list[OwnedPiece]:
        """This rank's own share of the fp32 weights and the rule's states, parameter by parameter, as views:
        a checkpoint writes them and reads into them directly, with no gather (see `load_owned_pieces`).
        This is the optimizer's one state format: checkpoints store it by name and global shape."""
        self.finish_update()
        return self.masters.owned_pieces()

    def load_owned_pieces(self, step: int | None = None, loss_scaler: dict | None = None,
                          iteration: int | None = None) -> None:
        """After new values were written through `owned_pieces()`: set the rule's step count, the loss scaler and the
        iteration (None: leave them, for a weights-only load) and refresh the model's parameters."""
        if step is not None:
            self.masters.step_count = step
        if loss_scaler is not None:
            self.scaler.load_state_dict(loss_scaler)
            self._device_scaler, self.unsettled_steps = None, 0  # made again from the loaded state
        if iteration is not None:
            self.iteration = iteration
        self.masters.publish()
        self.uncounted(self.stage.after_update)

    def meta_state(self) -> dict:
        """What a checkpoint's meta keeps of this optimizer beside the owned pieces: the rule's name, its step count,
        the loss scaler and the iteration; `load_owned_pieces(**meta_state minus "rule")` restores them."""
        return {"rule": self.rule.name, "step": self.adam_step(), "loss_scaler": self.scaler.state_dict(),
                "iteration": self.iteration}

    def adam_step(self) -> int:
        """The update rule's step count (the same on every rank: every rank steps, a rank whose slice is padding
        too); the name is the checkpoint's older one. With a delayed update pending, call `finish_update()` first
        (on every rank: it spreads the parameters)."""
        return self.masters.step_count
