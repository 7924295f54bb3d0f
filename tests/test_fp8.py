"""FP8 in the tensor-parallel linears (mpzero/tensor_parallel/fp8.py) against torchao's own Float8Linear on the same
bf16 weights and inputs, for each recipe and format torchao has, forward and every gradient, at TP 1 and 2; the
flags' bad combinations, one line each.

At TP 1 the layers run torchao's matmul and `_TensorParallelFp8Matmul` (the TP > 1 path) on a group of one: both
bitwise torchao's. At TP 2 the float8 operands are the slices of TP 1's (the scales are MAX-reduced over the group),
so what a rank computes whole is bitwise torchao's (a column-parallel output and weight gradient, a row-parallel
input and weight gradient); a sum the group splits (a row-parallel output, a column-parallel input gradient) is
each rank's bf16 partial product rounded before the all-reduce adds them: within 2 bf16 ulps of the largest value.
"""

import pytest
import torch

from mpzero.deferred_init import materialize_module, name_parameters, parameter_generator
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpzero.tensor_parallel.fp8 import (Fp8Linear, Fp8Recipe, _TensorParallelFp8Matmul, _torchao_float8,
                                        cpu_rowwise_scaled_mm)
from tests.cli import TINY, exit_code_and_stderr
from tests.distributed import run_ranks
from tests.fp8_marks import recipe_params

_torchao_float8()  # imported once here: the forked ranks inherit it
RECIPES = [("hybrid", "tensorwise"), ("e4m3", "tensorwise"), ("e4m3", "rowwise"), ("e4m3", "rowwise_with_gw_hp")]
IN, OUT = 64, 96


def _init(full, generator):
    torch.nn.init.normal_(full, std=0.5, generator=generator)


def _torchao_linear(recipe: Fp8Recipe):
    """torchao's Float8Linear holding the full weight the TP layers slice (the same generator, keyed by name)."""
    float8 = _torchao_float8()
    full = torch.empty(OUT, IN)
    _init(full, parameter_generator(0, "weight"))
    ref = float8.float8_linear.Float8Linear(IN, OUT, bias=True, config=recipe.config)
    with torch.no_grad():
        ref.weight.copy_(full)
        ref.bias.copy_(torch.linspace(-1, 1, OUT))
    return ref.to(torch.bfloat16)


def _tp_linear(kind: str, tp, recipe: Fp8Recipe):
    layer = (ColumnParallelLinear if kind == "column" else RowParallelLinear)(IN, OUT, tp, _init, bias=True)
    name_parameters(layer, seed=0)
    materialize_module(layer)
    with torch.no_grad():
        bias = torch.linspace(-1, 1, OUT)
        layer.bias.copy_(bias.chunk(tp.size)[tp.rank] if kind == "column" else bias)
    layer.to(torch.bfloat16).use_fp8(recipe)
    return layer


def _inputs():
    x = torch.randn(4, 8, IN, generator=torch.Generator().manual_seed(1)).bfloat16()
    grad = torch.randn(4, 8, OUT, generator=torch.Generator().manual_seed(2)).bfloat16()
    return x, grad


def _torchao_results(recipe: Fp8Recipe):
    x, grad = _inputs()
    ref = _torchao_linear(recipe)
    x = x.requires_grad_()
    y = ref(x)
    y.backward(grad)
    return y.detach(), x.grad, ref.weight.grad


def _mine(kind: str, layer, tp, direct: bool = False):
    """The layer's output, input gradient and weight gradient, each rank's share of torchao's shapes."""
    x, grad = _inputs()
    if kind == "column":
        grad = grad.chunk(tp.size, -1)[tp.rank]
    else:
        x = x.chunk(tp.size, -1)[tp.rank].contiguous()
    x = x.requires_grad_()
    if direct:  # the TP > 1 matmul itself, on a group of one
        y = _TensorParallelFp8Matmul.apply(x, layer.weight, Fp8Linear(layer.fp8.recipe, tp, kind)) + layer.bias
    else:
        y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad


def _within_two_ulps(mine: torch.Tensor, ref: torch.Tensor) -> None:
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().max())).item() - 7)  # bf16: 8 significant bits
    assert (mine.float() - ref.float()).abs().max().item() <= 2 * ulp


def _compare_tp(kind: str, fmt: str, name: str, tp_size: int, direct: bool = False):
    tp = init_parallel(tp_size).tp
    recipe = Fp8Recipe(fmt, name)
    y, gx, gw = _mine(kind, _tp_linear(kind, tp, recipe), tp, direct)
    ry, rgx, rgw = _torchao_results(recipe)
    r, t = tp.rank, tp.size
    if kind == "column":
        assert torch.equal(y, ry.chunk(t, -1)[r]) and torch.equal(gw, rgw.chunk(t, 0)[r])
        (torch.testing.assert_close(gx, rgx, rtol=0, atol=0) if t == 1 else _within_two_ulps(gx, rgx))
    else:
        assert torch.equal(gx, rgx.chunk(t, -1)[r]) and torch.equal(gw, rgw.chunk(t, 1)[r])
        (torch.testing.assert_close(y, ry, rtol=0, atol=0) if t == 1 else _within_two_ulps(y, ry))
    return True


@pytest.mark.parametrize("fmt,recipe", recipe_params(RECIPES))
@pytest.mark.parametrize("kind", ["column", "row"])
def test_tp1_linears_are_torchaos_float8_linear_bitwise(kind, fmt, recipe):
    assert run_ranks(1, _compare_tp, kind, fmt, recipe, 1) == [True]
    assert run_ranks(1, _compare_tp, kind, fmt, recipe, 1, True) == [True]  # the TP > 1 path on a group of one


@pytest.mark.parametrize("fmt,recipe", recipe_params(RECIPES))
@pytest.mark.parametrize("kind", ["column", "row"])
def test_tp2_linears_cast_with_the_whole_tensors_scales(kind, fmt, recipe):
    assert run_ranks(2, _compare_tp, kind, fmt, recipe, 2) == [True, True]


def _refusal_of_a_split_off_float8_sizes():
    tp = init_parallel(2).tp
    layer = RowParallelLinear(48, 64, tp, _init)
    try:
        layer.use_fp8(Fp8Recipe("hybrid"))
    except Exception as error:  # noqa: BLE001
        return str(error)


def test_a_layer_split_off_float8_sizes_is_one_line():
    message = run_ranks(2, _refusal_of_a_split_off_float8_sizes)[0]
    assert "[64, 48] is [64, 24] on each of 2 TP ranks, not multiples of 16" in message


def test_the_filters_choose_on_the_full_weight():
    assert Fp8Recipe("hybrid").chooses(64, 32) and not Fp8Recipe("hybrid").chooses(64, 40)
    assert not Fp8Recipe("hybrid", auto_filter_small_kn=True).chooses(1024, 4096)  # torchao: K <= 4096, N <= 1024
    assert Fp8Recipe("hybrid", auto_filter_small_kn=True).chooses(2048, 4096)
    assert not Fp8Recipe("e4m3", "rowwise", auto_filter_small_kn=True).chooses(2048, 8192)  # N <= 2048


@pytest.mark.parametrize("extra,message", [
    (["--fp8-format", "hybrid", "--bf16"], None),  # the valid run, as the control
    (["--fp8-format", "hybrid"], "but the run is fp32: add --bf16"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "delayed"], "--fp8-recipe delayed is Transformer Engine's"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "rowwise"], "torchao's rowwise recipe casts gradients to "
                                                                      "e4m3"),
    (["--bf16", "--fp8-recipe", "rowwise"], "--fp8-recipe shapes FP8 training, but --fp8-format is not given"),
    (["--fp8-format", "e4m3", "--bf16", "--first-last-layers-bf16"], "leave at least one of the 2 layers in FP8"),
    (["--fp8-format", "e4m3", "--bf16", "--hidden-size", "40"], "no linear of the transformer layers qualifies"),
    (["--fp8-format", "e4m3", "--bf16", "--fp8-recipe", "rowwise"],  # runs, or says this torch cannot here
     None if cpu_rowwise_scaled_mm() else "--fp8-recipe rowwise on the CPU needs row-wise scales"),
])
def test_bad_fp8_flags_are_one_line(extra, message):
    argv = TINY + ["--hidden-size", "64", "--train-iters", "1", "--eval-iters", "0"] + extra
    code, stderr = run_ranks(1, exit_code_and_stderr, argv)[0]
    if message is None:
        assert code == 0, stderr
    else:
        assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr, stderr


def test_without_torchao_the_flag_is_one_line(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(Exception, match=r"--fp8-format needs torchao, which is not installed: pip install"):
        Fp8Recipe("hybrid").validate()
