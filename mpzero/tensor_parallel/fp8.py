"""FP8 matmuls for the tensor-parallel linears through torchao's float8 training (Megatron's --fp8-format and
--fp8-recipe; torchao's recipes by torchao's names).

A linear in FP8 casts its input, its weight and, in backward, the output's gradient to float8 with a scale from the
tensor's amax (current scaling: this step's values, no history), and runs its three GEMMs (output, input gradient,
weight gradient) on the float8 operands (torch._scaled_mm): the weights, their gradients and the optimizer states
keep their dtypes, so memory, communication and checkpoints are those of the bf16 run. Recipes:
- tensorwise: one scale per tensor (torchao's default recipe; Megatron's `tensorwise` current scaling);
- rowwise: one scale per row of each GEMM operand, all e4m3, scales rounded down to powers of 2 (torchao);
- rowwise_with_gw_hp: rowwise, with the weight gradient's GEMM in high precision (torchao: its most accurate).
--fp8-format hybrid casts gradients to e5m2 and the forward's operands to e4m3 (torchao's tensorwise recipe);
e4m3 casts everything to e4m3 (torchao's rowwise recipes).

Tensor parallelism: a sharded operand's scale is taken over the whole tensor, not this rank's shard: where the amax
of a cast reduces over a dimension the TP group splits (a column-parallel weight's output rows and the gradient of
its output; a row-parallel weight's input columns and its input), the amaxes are MAX-reduced over the group first.
Every rank then casts its shard exactly as a single process casts that part of the whole tensor, and the float8
operands of a TP run are the slices of a TP 1 run's: a layout changes only the order of the GEMMs' sums, as in
bf16. At TP 1 the layers run torchao's own matmul (`matmul_with_hp_or_float8_args`, as its Float8Linear does);
at TP > 1 `_TensorParallelFp8Matmul`, the same casts and GEMMs with the reductions; tests/test_fp8.py compares
both with torchao's Float8Linear.

Which linears: the transformer layers' (QKV, attention output, the MLP's two), never the output layer (torchao's
and torchtitan's `filter_fqns=["output"]`), each only where its full weight's dimensions are multiples of 16
(_scaled_mm's requirement; torchao's filter), and with --fp8-auto-filter-small-kn only the sizes torchao's
auto filter finds faster in FP8 (torchtitan's `auto_filter_small_kn`); with --first-last-layers-bf16 not the first
--num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers (Megatron). Decided on the full weights'
shapes, so every layout puts the same linears in FP8.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache, cached_property

import torch
import torch.distributed as dist
from torch import nn

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.tensor_parallel.mappings import gather_sequence, reduce_scatter_sequence

FP8_FORMATS = ("e4m3", "hybrid")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MEGATRON_ONLY_RECIPES = ("delayed", "mxfp8", "blockwise", "custom")  # Transformer Engine's, not torchao's
FP8_RECIPES = TORCHAO_RECIPES + MEGATRON_ONLY_RECIPES
FP8_MULTIPLE = 16  # torch._scaled_mm: both dimensions of a float8 weight (torchao's filter)


@dataclass(frozen=True)
class Fp8Recipe:
    """--fp8-format, --fp8-recipe, --fp8-auto-filter-small-kn: how the chosen linears cast and which are chosen."""
    format: str
    recipe: str = "tensorwise"
    auto_filter_small_kn: bool = False

    def validate(self) -> None:
        """One ConfigError line for a combination torchao has no recipe for, or no torchao."""
        if self.format not in FP8_FORMATS:
            raise ConfigError(f"--fp8-format {self.format} is not one of {', '.join(FP8_FORMATS)}")
        if self.recipe in MEGATRON_ONLY_RECIPES:
            raise ConfigError(f"--fp8-recipe {self.recipe} is Transformer Engine's; mpzero's FP8 runs on torchao, "
                              f"whose recipes are {', '.join(TORCHAO_RECIPES)}: use --fp8-recipe tensorwise (current "
                              f"per-tensor scaling, Megatron's tensorwise)")
        if self.recipe not in TORCHAO_RECIPES:
            raise ConfigError(f"--fp8-recipe {self.recipe} is not one of {', '.join(TORCHAO_RECIPES)}")
        if self.recipe != "tensorwise" and self.format == "hybrid":
            raise ConfigError(f"torchao's {self.recipe} recipe casts gradients to e4m3 (--fp8-format e4m3); hybrid's "
                              f"e5m2 gradients are its tensorwise recipe: use --fp8-format e4m3 with --fp8-recipe "
                              f"{self.recipe}, or --fp8-recipe tensorwise")
        _torchao_float8()  # installed and importable

    def describe(self) -> str:
        small = ", small GEMMs in bf16 (torchao's auto filter)" if self.auto_filter_small_kn else ""
        return f"{self.format} {self.recipe} (torchao{small})"

    @cached_property
    def config(self):
        """torchao's Float8LinearConfig of this recipe and format."""
        float8 = _torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.recipe == "tensorwise" and self.format == "e4m3":  # gradients e4m3 too
            config = float8.Float8LinearConfig(
                cast_config_grad_output=float8.CastConfig(target_dtype=torch.float8_e4m3fn))
        return config

    @cached_property
    def mm_config(self):
        """torchao's LinearMMConfig for the three GEMMs, as its Float8Linear builds it."""
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
        c = self.config
        return LinearMMConfig(*(ScaledMMConfig(c.emulate, gemm.use_fast_accum, False, c.pad_inner_dim) for gemm in
                                (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))

    def chooses(self, out_features: int, in_features: int) -> bool:
        """Whether a linear of this full weight shape runs in FP8 (torchao's filters, on the full weight)."""
        if out_features % FP8_MULTIPLE or in_features % FP8_MULTIPLE:
            return False
        if not self.auto_filter_small_kn:
            return True
        from torchao.float8 import float8_linear_utils as utils
        probe = nn.Linear(in_features, out_features, bias=False, device="meta")
        recipe = "rowwise" if self.recipe == "rowwise_with_gw_hp" else self.recipe  # torchao has none of its own
        return utils._auto_filter_for_recipe(recipe, [])(probe, "")


def check_fp8_flags(config) -> None:
    """A model config's FP8 fields (`GPTConfig`: Megatron's flags), each problem one ConfigError line."""
    if config.fp8_format is None:
        given = [flag for flag, on in (("--fp8-recipe", config.fp8_recipe != "tensorwise"),
                                       ("--fp8-auto-filter-small-kn", config.fp8_auto_filter_small_kn),
                                       ("--first-last-layers-bf16", config.first_last_layers_bf16)) if on]
        if given:
            raise ConfigError(f"{given[0]} shapes FP8 training, but --fp8-format is not given: add --fp8-format "
                              f"hybrid (or e4m3), or drop {given[0]}")
        return
    config.fp8.validate()
    if not any(config.fp8.chooses(n, k) for _, k, n in layer_linears(config)):
        raise ConfigError(f"--fp8-format {config.fp8_format}: no linear of the transformer layers qualifies for FP8 "
                          f"(both dimensions multiples of {FP8_MULTIPLE}, and with --fp8-auto-filter-small-kn large "
                          f"enough): drop --fp8-format, or change the sizes")
    start, end = config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16
    if config.first_last_layers_bf16 and (min(start, end) < 0 or start + end >= config.num_layers):
        raise ConfigError(f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end} must be "
                          f">= 0 and leave at least one of the {config.num_layers} layers in FP8")


@cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `torch._scaled_mm` takes row-wise scales (2.13's does; 2.11's asserts one scale per
    tensor): what the rowwise recipes need on a CPU."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def require_cpu_rowwise(recipe: str) -> None:
    """One ConfigError line where a rowwise recipe would run on a CPU whose torch cannot."""
    if not cpu_rowwise_scaled_mm():
        raise ConfigError(f"--fp8-recipe {recipe} on the CPU needs row-wise scales in torch._scaled_mm, which torch "
                          f"{torch.__version__} has only on CUDA: use --fp8-recipe tensorwise, a GPU, or torch 2.13")


def _torchao_float8():
    """torchao.float8, imported quietly (torchao logs each optional CUDA extension a CPU machine cannot load)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError("--fp8-format needs torchao, which is not installed: pip install -e '.[fp8]', or drop "
                          "--fp8-format") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return float8


# The dimension of each operand the TP group splits, by linear: weight_t is weight.t() ([in, out]), as torchao's
# matmul takes it; grad_output and input are [..., features]. None: whole on every rank.
SHARDED_DIMS = {"column": {"input": None, "weight": 1, "grad_output": -1},
                "row": {"input": -1, "weight": 0, "grad_output": None}}


def _spans_split(granularity, dim: int | None, ndim: int, split: int | None) -> bool:
    """Whether a cast's amax (over the whole tensor, or along `dim`) reduces over the TP-split dimension `split`."""
    from torchao.float8.config import ScalingGranularity
    if split is None:
        return False
    return granularity is ScalingGranularity.TENSORWISE or dim % ndim == split % ndim


def _amax_key(operand: str, granularity, dim: int | None, ndim: int) -> tuple:
    """What identifies a reduced amax within one linear's forward and backward: a tensorwise amax is the operand's
    whatever its shape (torchao casts the weight again in backward, and the output gradient for both backward
    GEMMs: the same values, so one all-reduce serves), an axiswise one its axis."""
    from torchao.float8.config import ScalingGranularity
    return (operand,) if granularity is ScalingGranularity.TENSORWISE else (operand, dim % ndim, ndim)


def _casts(config) -> list[tuple[str, object, int]]:
    """(operand, torchao cast config, axiswise dim) of the six casts of a linear's forward and backward, in order."""
    return [("input", config.cast_config_input, -1), ("weight", config.cast_config_weight, 0),
            ("grad_output", config.cast_config_grad_output, -1),
            ("weight", config.cast_config_weight_for_grad_input, -1),
            ("grad_output", config.cast_config_grad_output_for_grad_weight, 0),
            ("input", config.cast_config_input_for_grad_weight, 0)]


def amax_reduced_elements(recipe: Fp8Recipe, kind: str, in_features: int, out_features: int, tp: int,
                          tokens: int) -> int:
    """fp32 elements a TP rank's FP8 linear (full weight [out, in]) all-reduces per forward and backward of `tokens`
    tokens: the amaxes of its casts that span a split dimension (`Fp8Linear.cast`), each once; 0 at TP 1."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    if tp == 1:
        return 0
    k, n = (in_features, out_features // tp) if kind == "column" else (in_features // tp, out_features)
    shapes = {"input": (tokens, k), "weight": (k, n), "grad_output": (tokens, n)}  # 2-D, weight as weight.t()
    reduced = {}
    for operand, cast, dim in _casts(recipe.config):
        if cast.scaling_type is ScalingType.DISABLED:
            continue
        axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        if _spans_split(cast.scaling_granularity, dim, 2, SHARDED_DIMS[kind][operand]):
            elements = shapes[operand][1 if dim % 2 == 0 else 0] if axiswise else 1
            reduced[_amax_key(operand, cast.scaling_granularity, dim, 2)] = elements
    return sum(reduced.values())


@dataclass(frozen=True, eq=False)
class Fp8Linear:
    """What a tensor-parallel linear in FP8 needs at each call: the recipe, its TP group and its kind."""
    recipe: Fp8Recipe
    group: CommGroup
    kind: str  # "column" or "row"
    gather_sequence: bool = False  # column-parallel under sequence parallelism: the input is this rank's slice

    def cast(self, hp: torch.Tensor, cast_config, axiswise_dim: int, operand: str, role, reduced: dict):
        """`hp` as torchao's Float8TrainingTensor (or itself where the recipe keeps it in high precision), its
        amax MAX-reduced over the TP group where it reduces over a split dimension; `reduced` keeps the call's
        reduced amaxes (`_amax_key`), so an amax torchao takes twice is all-reduced once."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
        if cast_config.scaling_type is ScalingType.DISABLED:
            return hp
        granularity = cast_config.scaling_granularity
        dim = get_maybe_axiswise_dim(axiswise_dim, granularity)
        if self.group.size > 1 and _spans_split(granularity, dim, hp.dim(), SHARDED_DIMS[self.kind][operand]):
            key = _amax_key(operand, granularity, dim, hp.dim())
            if key not in reduced:  # exact: a bf16 amax widened (amax_to_scale widens it to fp64)
                reduced[key] = tensor_to_amax(hp, False, None, granularity, dim).float().contiguous()
                self.group.all_reduce(reduced[key], op=dist.ReduceOp.MAX)
            amax = reduced[key]
        else:
            amax = tensor_to_amax(hp, False, None, granularity, dim)
        scale = amax_to_scale(amax, cast_config.target_dtype, self.recipe.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(hp, scale, cast_config.target_dtype, self.recipe.mm_config, role, dim)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, gathered=None) -> torch.Tensor:
        """x W^T in FP8 (x [..., in] whole, or this rank's sequence slice when `gather_sequence`). `gathered`: the
        weight ZeRO-3 gathered in float8 (`zero.fp8_gather.GatheredFp8Weight`, --fp8-param-gather), used in place
        of casting `weight`, which still receives the gradient."""
        if x.device.type == "cpu" and self.recipe.recipe != "tensorwise" and not torch.compiler.is_compiling():
            require_cpu_rowwise(self.recipe.recipe)
        if self.group.size == 1 and gathered is None:
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
            return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.recipe.mm_config, self.recipe.config)
        return _TensorParallelFp8Matmul.apply(x, weight, self, gathered)


class _TensorParallelFp8Matmul(torch.autograd.Function):
    """torchao's matmul_with_hp_or_float8_args with TP-wide scales (`Fp8Linear.cast`); under sequence parallelism
    it keeps the input's slice for backward and gathers it again there (as `linear_with_sequence_gather`). With a
    weight gathered in float8 (tensorwise: the same bits and scale as its cast) both GEMMs use that one; its buffer
    is gathered again for backward, as the bf16 weight's is."""

    @staticmethod
    def forward(ctx, x, weight, linear: Fp8Linear, gathered=None):
        from torchao.float8.float8_training_tensor import GemmInputRole
        ctx.save_for_backward(x, weight if gathered is None else None)
        ctx.linear, ctx.reduced = linear, {}  # the weight's tensorwise amax serves backward's cast too
        c = linear.recipe.config
        full = gather_sequence(x, linear.group) if linear.gather_sequence else x
        x8 = linear.cast(full, c.cast_config_input, -1, "input", GemmInputRole.INPUT, ctx.reduced)
        if gathered is None:
            w8 = linear.cast(weight.t(), c.cast_config_weight, 0, "weight", GemmInputRole.WEIGHT, ctx.reduced)
        else:
            w8 = gathered.float8(linear.recipe.mm_config, weight.dtype).t()
        ctx.gathered = None if gathered is None else w8
        out = torch.mm(x8.reshape(-1, x8.shape[-1]), w8)
        return out.reshape(*x8.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.float8_training_tensor import GemmInputRole
        x, weight = ctx.saved_tensors
        linear, reduced = ctx.linear, ctx.reduced
        c = linear.recipe.config
        full = gather_sequence(x, linear.group) if linear.gather_sequence else x
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        g8 = linear.cast(grad_2d, c.cast_config_grad_output, -1, "grad_output", GemmInputRole.GRAD_OUTPUT, reduced)
        w8 = ctx.gathered if ctx.gathered is not None else linear.cast(
            weight.t(), c.cast_config_weight_for_grad_input, -1, "weight", GemmInputRole.WEIGHT, reduced)
        grad_input = torch.mm(g8, w8.t()).reshape(*grad_output.shape[:-1], -1)
        if linear.gather_sequence:
            grad_input = reduce_scatter_sequence(grad_input, linear.group)
        full_2d = full.reshape(-1, full.shape[-1])
        g8 = linear.cast(grad_2d, c.cast_config_grad_output_for_grad_weight, 0, "grad_output",
                         GemmInputRole.GRAD_OUTPUT, reduced)
        x8 = linear.cast(full_2d, c.cast_config_input_for_grad_weight, 0, "input", GemmInputRole.INPUT, reduced)
        return grad_input, torch.mm(g8.t(), x8), None, None


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe, bf16_layers: set[int]) -> list[str]:
    """Puts the tensor-parallel linears of `model.layers` that the recipe chooses (`Fp8Recipe.chooses`), outside the
    global layer indices `bf16_layers`, in FP8; returns their names. The output layer is never converted. (A pipeline
    stage's layers are numbered globally: `layers.indices`.)"""
    from mpzero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    converted = []
    for index, layer in zip(getattr(model.layers, "indices", range(len(model.layers))), model.layers):
        if index in bf16_layers:
            continue
        for name, module in layer.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and recipe.chooses(
                    module.out_features, module.in_features):
                module.use_fp8(recipe)
                converted.append(f"layers.{index}.{name}")
    return converted


def layer_linears(config) -> list[tuple[str, int, int]]:
    """(kind, in features, out features) of a transformer layer's tensor-parallel linears, full weights, from its
    config (`GPTConfig`): QKV and fc1 column-parallel, the attention output and fc2 row-parallel."""
    h, ffn, d = config.hidden_size, config.ffn_size, config.head_dim
    return [("column", h, (config.num_attention_heads + 2 * config.query_groups) * d),
            ("row", config.attention_width, h), ("column", h, 2 * ffn if config.swiglu else ffn), ("row", ffn, h)]
