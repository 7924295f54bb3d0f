"""--cuda-graph-impl local: the trunk compiled as one region (--torch-compile) is captured by inductor's CUDA graph
trees. This CPU has no CUDA graphs, so what is proven here is the contract around them: every configuration the
trunk cannot be one region in is refused in one line before anything is built; the option reaches inductor
(it asks for CUDA graphs and, on this device, counts the skip); and the run is otherwise the plain --torch-compile
run, bitwise. The graphs themselves are exercised on a GPU by `make gpu-check`: bench_gpt2's graphed variants (the
losses of their partners without graphs, their graph launches counted) and tests/gpu/test_gpt_cuda.py."""

import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import RanksFailed, run_ranks

GRAPHS = ["--torch-compile", "--cuda-graph-impl", "local"]


def _tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "vocab_size": 50,
                        "max_position_embeddings": 8, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                        "torch_compile": True, "cuda_graph_impl": "local", **overrides})


@pytest.mark.parametrize("overrides, tp, message", [
    ({"torch_compile": False}, 1, "replays the CUDA graphs of the model's compiled trunk: add --torch-compile"),
    ({"recompute_activations": True}, 1, "(selective recomputation runs eagerly around or inside the layers)"),
    ({"recompute_granularity": "full"}, 1, "(full recomputation runs eagerly"),
    ({"offload_activations": "cpu"}, 1, "(--offload-activations cpu moves the saved tensors to the host"),
    ({}, 2, "(at TP > 1 each layer's collectives run eagerly): drop --cuda-graph-impl local"),
    ({"cuda_graph_impl": "global"}, 1, "--cuda-graph-impl global is not one of none, local")],
    ids=["no-compile", "selective", "full", "host-activations", "tp2", "unknown"])
def test_a_trunk_that_cannot_be_one_region_is_refused(overrides, tp, message):
    with pytest.raises(ConfigError) as error:
        _tiny(**overrides).validate(tp)
    assert message in str(error.value)


@pytest.mark.parametrize("flags, message", [
    (["--cuda-graph-impl", "local"], "add --torch-compile"),
    (GRAPHS + ["--zero-stage", "3"], "ZeRO-3's gather and release hooks split into layers: use --zero-stage 0-2"),
    (GRAPHS + ["--recompute-activations"], "(selective recomputation runs eagerly")])
def test_the_cli_refuses_them_in_one_line_before_any_work(flags, message):
    code, err = exit_code_and_stderr(TINY + flags)
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err


def _trunk_run(cuda_graph_impl: str, hooked: bool = False) -> tuple[list, list, int]:
    """Two forward/backward passes of a tiny compiled model: (losses, gradients, inductor's CUDA graph skips)."""
    from torch._dynamo.utils import counters  # inductor's own tally: a graph that asked for CUDA graphs and got none
    torch.manual_seed(0)
    model = GPTModel(_tiny(cuda_graph_impl=cuda_graph_impl, num_layers=1), init_parallel(1).tp)
    if hooked:  # as ZeRO-3 gathers and releases each layer's parameters
        model.layers[0].register_forward_pre_hook(lambda module, args: None)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        loss = model(tokens, tokens, reduction="mean")
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()], counters["inductor"]["cudagraph_skips"]


@pytest.mark.product
def test_on_the_cpu_the_option_reaches_inductor_and_changes_nothing_computed():
    plain = run_ranks(1, _trunk_run, "none", deadline=300)[0]
    graphed = run_ranks(1, _trunk_run, "local", deadline=300)[0]
    assert plain[2] == 0 and graphed[2] > 0  # asked for CUDA graphs; this device has none to capture
    assert graphed[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(graphed[1], plain[1]))


def test_forward_hooks_on_the_trunk_are_refused_not_run_without_graphs():
    with pytest.raises(RanksFailed, match="ConfigError: --cuda-graph-impl local captures the trunk as one compiled "
                                          "region, but its modules have forward hooks"):
        run_ranks(1, _trunk_run, "local", hooked=True)


@pytest.mark.product
def test_through_the_cli_the_losses_are_the_compiled_runs_and_the_line_says_no_graphs_on_the_cpu():
    argv = TINY + ["--train-iters", "3", "--eval-iters", "0", "--torch-compile"]
    plain = run_ranks(1, main_capturing_stdout, argv, deadline=300)[0][0]
    graphed, stdout = run_ranks(1, main_capturing_stdout, argv + ["--cuda-graph-impl", "local"], deadline=300)[0]
    assert graphed["losses"] == plain["losses"] and graphed["grad_norms"] == plain["grad_norms"]
    assert '"cuda_graphs": "none (local captures CUDA graphs; this device is cpu)"' in stdout
