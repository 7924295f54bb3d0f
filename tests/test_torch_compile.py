"""--torch-compile (each TransformerLayer's forward through torch.compile, inductor's C++ backend on this CPU; where
nothing in the trunk runs eagerly, embedding, layers and final norm as one compiled region) against the eager run
through the CLI: the same losses and gradient norms within 1e-5 relative in fp32 (inductor fuses elementwise chains
and reorders reductions: float rounding, never a different computation), at TP 1 with ZeRO-1 (one region) and ZeRO-3
(its gather/release hooks around each compiled layer), and at TP 2 with ZeRO-3, sequence parallelism and selective
recomputation; bf16 within 2e-2 (one bf16 rounding of a fused chain differs from the eager op-by-op roundings).
Dropout is 0: compiled dropout draws its masks from inductor's generator. Compilation costs seconds per rank: the
models are tiny and the runs share the run's one inductor cache and compile in their own process (tests/conftest.py)."""

import pytest
import torch

from mpzero.activations import COMPILED_TRUNK, SavedBytesCounter
from mpzero.models import GPTConfig, GPTModel
from mpzero.models.gpt import trunk_compilable
from mpzero.parallel import init_parallel
from tests.cli import TINY, assert_close_lists, main_capturing_stdout
from tests.distributed import run_ranks

ITERS = ["--train-iters", "3", "--eval-iters", "0"]  # no evaluation: no no-grad graphs to compile


def _history(argv):
    history, stdout = main_capturing_stdout(argv)
    return history, stdout


def _losses_and_norms(world, flags):
    eager = run_ranks(world, _history, TINY + ITERS + flags, deadline=300)[0][0]
    compiled, stdout = run_ranks(world, _history, TINY + ITERS + flags + ["--torch-compile"], deadline=300)[0]
    return eager, compiled, stdout


@pytest.mark.product  # make test: the TP 2 x ZeRO-3 x SP x selective comparison below
@pytest.mark.parametrize("stage", [1, 3])
def test_compiled_layers_match_eager_at_tp1(stage):
    eager, compiled, stdout = _losses_and_norms(1, ["--zero-stage", str(stage)])
    assert_close_lists(compiled["losses"], eager["losses"], rel=1e-5)
    assert_close_lists(compiled["grad_norms"], eager["grad_norms"], rel=1e-5)
    # TP 1, no recomputation: the layers run as one region, unless ZeRO-3's hooks must run around each
    assert ("(one compiled region)" in stdout) is (stage == 1)


def _tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "vocab_size": 50,
                        "max_position_embeddings": 8, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                        "torch_compile": True, **overrides})


def _regions(overrides: dict, hooked: str | None = None) -> tuple[set, int]:
    """(the activation regions a --torch-compile'd forward's saved tensors were counted in, the forward pre-hook
    calls); `hooked`: "layers", each layer has one, as ZeRO-3 gives its units; "embedding", the embedding's
    (a unit of a library user's choice)."""
    from mpzero.tensor_parallel import seed_everything
    model = GPTModel(_tiny(**overrides), init_parallel(1).tp, seed_everything(1, 0, torch.device("cpu")))
    calls = []
    for module in {None: [], "layers": model.layers, "embedding": [model.embedding.word_embeddings]}[hooked]:
        module.register_forward_pre_hook(lambda module, args: calls.append(module))
    counter = SavedBytesCounter(model)
    tokens = torch.randint(0, 50, (2, 8))
    with counter.counting():
        loss = model(tokens, tokens, reduction="mean")
    loss.backward()
    return {region for region, nbytes in counter.device_bytes.items() if nbytes}, len(calls)


@pytest.mark.parametrize("overrides, one_region", [({}, True), ({"recompute_activations": True}, False),
                                                   ({"recompute_granularity": "full"}, False),
                                                   ({"offload_activations": "cpu"}, False)],
                         ids=["plain", "selective", "full", "host-activations"])
def test_the_layers_are_one_compiled_region_only_where_nothing_between_them_runs_eagerly(overrides, one_region):
    config = _tiny(**overrides)
    assert trunk_compilable(config, 1) is one_region and not trunk_compilable(config, 2)
    if one_region:
        assert run_ranks(1, _regions, overrides, deadline=300)[0] == ({COMPILED_TRUNK, None}, 0)


@pytest.mark.parametrize("hooked, calls", [("layers", 2), ("embedding", 1)])
def test_a_trunk_with_forward_hooks_runs_module_by_module(hooked, calls):
    # ZeRO-3 gathers and releases each unit's parameters from forward hooks: they must run around their module
    assert run_ranks(1, _regions, {}, hooked=hooked, deadline=300)[0] == ({0, 1, None}, calls)


def test_compiled_layers_match_eager_at_tp2_zero3_sp_selective():
    flags = ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--sequence-parallel",
             "--recompute-activations"]
    eager, compiled, _ = _losses_and_norms(2, flags)
    assert_close_lists(compiled["losses"], eager["losses"], rel=1e-5)
    assert_close_lists(compiled["grad_norms"], eager["grad_norms"], rel=1e-5)


def test_compiled_layers_match_eager_in_bf16():
    eager, compiled, _ = _losses_and_norms(1, ["--bf16"])
    assert_close_lists(compiled["losses"], eager["losses"], rel=2e-2)
