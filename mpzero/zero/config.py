"""The config sections the ZeRO optimizer receives: partitioning, the optimizer (its update rule), precision,
and offload.

Defaults follow Megatron-LM (`--initial-loss-scale 2**32`, `--min-loss-scale 1`,
`--loss-scale-window 1000`, `--hysteresis 2`, `--adam-beta1 0.9`, `--adam-beta2 0.999`,
`--adam-eps 1e-8`, `--weight-decay 0.01`, `--clip-grad 1.0`, DDP buckets of 40M elements).
`validate()` only checks; it never mutates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpzero.errors import ConfigError
from mpzero.optim import AdamW, UpdateRule

ZERO_UNITS = ("layer", "linear")  # stage 3's units: transformer layers, or the linear layers inside them
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 1  # --zero-stage: 0 replicated (DDP), 1 optimizer states, 2 + gradients, 3 + parameters
    bucket_numel: int = 40_000_000  # --zero-bucket-numel: elements per gradient bucket (stages 0-2)
    overlap_comm: bool = True  # reduce a bucket from its gradient hooks while backward still runs
    prefetch: bool = True  # stage 3: start gathering the next unit while the current one computes
    units: str = "layer"  # --zero-units (stage 3): gather each transformer layer, or each linear layer in it
    fp8_param_gather: bool = False  # --fp8-param-gather (stage 3): tensorwise FP8 weights gathered in float8
    check_for_nan_in_grad: bool = True  # Megatron's --check-for-nan-in-loss-and-grad: a non-finite gradient
    # norm (bf16/fp32) stops the run before the update; fp16 skips the step instead (loss scaling)

    def validate(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage {self.stage} is not one of 0, 1, 2, 3")
        if self.units not in ZERO_UNITS:
            raise ConfigError(f"--zero-units {self.units} is not one of {', '.join(ZERO_UNITS)}")
        if self.bucket_numel < 1:
            raise ConfigError(f"--zero-bucket-numel {self.bucket_numel} must be a positive number of elements")


def check_zero_units(zero: ZeroConfig, torch_compile: bool, cuda_graph_impl: str) -> None:
    """ZeRO's units against how the model's layers are compiled: one ConfigError line for what cannot run."""
    if zero.units != "layer" and zero.stage != 3:
        raise ConfigError(f"--zero-units {zero.units} chooses what stage 3 gathers at once, but --zero-stage is "
                          f"{zero.stage}: drop it or use --zero-stage 3")
    if zero.units != "layer" and torch_compile:
        raise ConfigError(f"--zero-units {zero.units} gathers units inside a transformer layer, which "
                          "--torch-compile compiles whole: drop one of them")
    if cuda_graph_impl != "none" and zero.stage == 3:
        raise ConfigError(f"--cuda-graph-impl {cuda_graph_impl} captures the trunk as one compiled region, which "
                          "ZeRO-3's gather and release hooks split into layers: use --zero-stage 0-2 or drop "
                          "--cuda-graph-impl")


def check_fp8_param_gather(zero: ZeroConfig, fp8, offload: "OffloadConfig") -> None:
    """--fp8-param-gather against the FP8 recipe (`Fp8Recipe` or None), the stage and offload: one ConfigError line
    for what it cannot do."""
    if not zero.fp8_param_gather:
        return
    if fp8 is None:
        raise ConfigError("--fp8-param-gather gathers the FP8 linears' weights in float8, but --fp8-format is not "
                          "given: add --fp8-format hybrid (or e4m3), or drop --fp8-param-gather")
    if fp8.recipe != "tensorwise":
        raise ConfigError(f"--fp8-param-gather needs --fp8-recipe tensorwise: {fp8.recipe} scales a weight per row "
                          f"in forward and per column in backward, so no one float8 copy serves both GEMMs (torchao "
                          f"gathers rowwise weights in bf16 too): use --fp8-recipe tensorwise or drop the flag")
    if zero.stage != 3:
        raise ConfigError(f"--fp8-param-gather with --zero-stage {zero.stage}: Megatron's flag keeps the weights "
                          f"in FP8 between steps and all-gathers them in FP8 after the update; mpzero keeps bf16 "
                          f"weights (FP8 only inside the linears' casts) and only ZeRO-3 gathers weights for compute, "
                          f"so the float8 gather is ZeRO-3's: use --zero-stage 3 or drop --fp8-param-gather")
    if offload.params != "none":
        raise ConfigError(f"--fp8-param-gather with --offload-params {offload.params}: offloaded shards are "
                          f"gathered in bf16 from their staging buffer, casting them to float8 there is not built: "
                          f"drop one of them")


OFFLOAD_TIERS = ("none", "cpu", "disk")
OFFLOAD_IO = ("auto", "direct", "buffered")
DIRECT_IO_ALIGN = 4096  # bytes: O_DIRECT offsets, lengths and buffer addresses are multiples of this


@dataclass(frozen=True)
class OffloadConfig:
    """Where this rank's ZeRO partition of model states lives beyond the device (ZeRO-Offload, ZeRO-Infinity).

    optimizer: the fp32 masters and Adam moments (stages 1-3), updated by AdamW on the CPU: `cpu` in host
    memory, `disk` in files under `path`, streamed through `buffer_count` buffers of `sub_group_numel`
    elements. params: this rank's low-precision parameter shards (stage 3 only, with the optimizer offloaded
    too), fetched ahead of the gather. Every rank keeps its files under `{path}/rank{global rank:05d}`.
    """
    optimizer: str = "none"  # --offload-optimizer none|cpu|disk (Megatron's --optimizer-cpu-offload = cpu)
    params: str = "none"  # --offload-params none|cpu|disk
    path: str | None = None  # --offload-path: directory for the disk tier
    sub_group_numel: int = 16_777_216  # --offload-sub-group-numel: partition elements updated per swap
    buffer_count: int = 3  # --offload-buffer-count: sub-group buffers (3: read next, update, write previous)
    io: str = "auto"  # --offload-io: direct (O_DIRECT), buffered, or auto (direct where the file system allows)
    pin_memory: bool = True  # host buffers page-locked on a CUDA run (--no-offload-pin-memory)
    delayed_update_after: int | None = None  # --offload-delayed-update-after N: ZeRO-Offload's DPU after N steps

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.params != "none"

    @property
    def uses_disk(self) -> bool:
        return "disk" in (self.optimizer, self.params)

    def streams_grads(self, stage: int) -> bool:
        """Whether the gradient partition lives in host memory, each reduced bucket streamed there in backward
        (issue 24, item 3): an offloaded optimizer at stages 2-3 (stage 1 keeps full gradient buffers on the
        device to accumulate micro-batches; the step copies its slice down, sub-group by sub-group)."""
        return self.optimizer != "none" and stage >= 2

    def grads_tier(self, stage: int) -> str:
        """Where the gradient partition lives between backward and the step: "none" (the device), "cpu" (streamed
        to host memory) or "disk" (streamed on to a file: ZeRO-Infinity keeps gradients with the optimizer's states
        on NVMe), the offloaded optimizer's tier at stages 2-3."""
        return self.optimizer if self.streams_grads(stage) else "none"

    def validate(self, stage: int) -> None:
        """Checks that need no file system (the path itself is checked where the run starts)."""
        for flag, tier in (("--offload-optimizer", self.optimizer), ("--offload-params", self.params)):
            if tier not in OFFLOAD_TIERS:
                raise ConfigError(f"{flag} {tier!r} is not one of {', '.join(OFFLOAD_TIERS)}")
        if self.io not in OFFLOAD_IO:
            raise ConfigError(f"--offload-io {self.io!r} is not one of {', '.join(OFFLOAD_IO)}")
        if self.optimizer != "none" and stage == 0:
            raise ConfigError(f"--offload-optimizer {self.optimizer} needs --zero-stage 1, 2 or 3 (stage 0 "
                              "replicates the optimizer state on every rank): raise --zero-stage")
        if self.params != "none" and stage != 3:
            raise ConfigError(f"--offload-params {self.params} needs --zero-stage 3 (only stage 3 partitions "
                              f"parameters), got --zero-stage {stage}")
        if self.params != "none" and self.optimizer == "none":
            raise ConfigError(f"--offload-params {self.params} needs --offload-optimizer cpu or disk: the "
                              "parameters are updated where the optimizer state lives")
        if self.uses_disk and not self.path:
            raise ConfigError("the disk tier (--offload-optimizer/--offload-params disk) needs --offload-path DIR")
        if self.path and not self.uses_disk:
            raise ConfigError("--offload-path is only used by the disk tier: add --offload-optimizer disk "
                              "(or --offload-params disk), or drop --offload-path")
        if self.sub_group_numel < 1 or self.buffer_count < 3:
            raise ConfigError(f"--offload-sub-group-numel {self.sub_group_numel} must be positive and "
                              f"--offload-buffer-count {self.buffer_count} at least 3 (read, update, write)")
        if self.delayed_update_after is not None and self.optimizer == "none":
            raise ConfigError(f"--offload-delayed-update-after {self.delayed_update_after} needs --offload-optimizer "
                              "cpu or disk: the delayed update is the offloaded optimizer's CPU step")
        if self.delayed_update_after is not None and (not isinstance(self.delayed_update_after, int)
                                                      or self.delayed_update_after < 0):
            raise ConfigError(f"--offload-delayed-update-after {self.delayed_update_after} must be a whole number "
                              "of warm-up steps >= 0")
        if self.io == "direct" and (self.sub_group_numel * 4) % DIRECT_IO_ALIGN:
            raise ConfigError(f"--offload-io direct needs --offload-sub-group-numel to be a multiple of "
                              f"{DIRECT_IO_ALIGN // 4} elements (O_DIRECT transfers {DIRECT_IO_ALIGN}-byte "
                              f"blocks), got {self.sub_group_numel}")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer section: what every update rule shares (Megatron's --lr, --weight-decay, --clip-grad) and
    the rule itself, a value carrying its own hyperparameters (mpzero.optim: AdamW, SGD)."""
    lr: float = 1e-4
    weight_decay: float = 0.01  # on the parameters ZeroOptimizer's `decay` rule picks (default: Megatron's, those
    # with ndim >= 2: not biases and LayerNorm parameters); AdamW decouples it, SGD adds it to the gradient
    clip_grad: float = 1.0  # max global gradient norm; 0 disables clipping
    impl: str = "auto"  # the rule's implementation (AdamW: mpzero.fused adamw_step); --no-adam-fusion gives "torch"
    rule: UpdateRule = AdamW()  # --optimizer adam|sgd and the rule's own flags

    def validate(self) -> None:
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError("--lr, --weight-decay and --clip-grad must be >= 0, "
                              f"got lr {self.lr}, weight decay {self.weight_decay}, clip {self.clip_grad}")
        self.rule.validate()


def AdamConfig(lr: float = 1e-4, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,  # noqa: N802
               weight_decay: float = 0.01, clip_grad: float = 1.0, impl: str = "auto") -> OptimizerConfig:
    """The optimizer section with the AdamW rule, under the section's former name and fields (Megatron keeps
    AdamOptimizerConfig as an alias of its OptimizerConfig the same way)."""
    return OptimizerConfig(lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, impl=impl,
                           rule=AdamW(beta1=beta1, beta2=beta2, eps=eps))


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"  # model parameters: fp32 | bf16 | fp16 (master weights are always fp32)
    initial_loss_scale: float = 2.0 ** 32  # fp16 dynamic scaling starts here
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # clean steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    loss_scale: float | None = None  # static scale (fp16); None = dynamic
    max_skips_at_min_scale: int = 10  # consecutive fp16 overflows at the minimum (or static) scale that stop
    # the run (DeepSpeed's raise_error_at_min_scale): it would otherwise skip every step and save an untrained model
    accumulate_allreduce_grads_in_fp32: bool | None = None  # --accumulate-allreduce-grads-in-fp32: gradient
    # buffers, their accumulation and their reduction in fp32 (4 bytes per element) instead of the parameters'
    # dtype (2); None is Megatron's default: on for bf16 (off with --grad-reduce-in-bf16), off for fp16

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradient buffers' dtype, which the reductions communicate. Megatron's rule
        (megatron/training/arguments.py): bf16 accumulates and all-reduces in fp32 unless --grad-reduce-in-bf16
        (bf16's 8-bit mantissa rounds small gradients away as micro-batches and ranks add up); fp16 keeps fp16
        gradients (the ZeRO paper's 2+2+12 bytes) unless --accumulate-allreduce-grads-in-fp32."""
        fp32 = self.accumulate_allreduce_grads_in_fp32
        if fp32 is None:
            fp32 = self.dtype != "fp16"
        return torch.float32 if fp32 else self.torch_dtype

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"precision {self.dtype!r} is not one of fp32, bf16, fp16")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale {self.loss_scale} must be positive (or omitted for dynamic scaling)")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale {self.min_loss_scale} must be positive and at most "
                              f"--initial-loss-scale {self.initial_loss_scale}")
        if self.max_skips_at_min_scale < 1:
            raise ConfigError(f"max_skips_at_min_scale {self.max_skips_at_min_scale} must be at least 1")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ConfigError(f"--loss-scale-window {self.loss_scale_window} and --hysteresis "
                              f"{self.hysteresis} must be at least 1")
