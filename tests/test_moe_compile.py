"""--torch-compile with mixture-of-experts layers (inductor's C++ backend on this CPU): each transformer layer compiles
(torchtitan's per-block compilation) with the MoE dispatch, which reads the routing's split sizes on the host, run
eagerly between compiled pieces (moe/layer.py). Against the same model run eagerly: losses and every gradient within
1e-5 relative in fp32 (inductor fuses and reorders float sums; never a different computation), at EP 1 and EP 2
(alltoall and allgather); the compiled graphs are made once, at the first step, and none is added in later steps
although each step routes other counts of tokens to each expert (dynamo's graph counter), so nothing recompiles as
the split sizes change. Through the CLI (product): the run's losses and gradient norms are the eager run's."""

import pytest
import torch

from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from tests.cli import assert_close_lists, quiet_main
from tests.distributed import run_ranks
from tests.test_moe_layouts import BASE, LLAMA

STEPS = 3


def _config(compiled: bool, dispatcher: str) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=50, max_position_embeddings=8,
                     hidden_dropout=0.0, attention_dropout=0.0, torch_compile=compiled, num_experts=4,
                     moe_ffn_hidden_size=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                     moe_token_dispatcher_type=dispatcher)


def _steps(ep_size: int, dispatcher: str, compiled: bool):
    """(per step: loss, {name: grad}, tokens per expert, dynamo's graphs so far) of STEPS forward/backward passes
    on this rank's own tokens."""
    import torch._dynamo
    groups = init_parallel(1, ep_size=ep_size)
    model = GPTModel(_config(compiled, dispatcher), groups.tp, seed_everything(1, 0, torch.device("cpu")),
                     ep=groups.ep, expert_tp=groups.expert_tp)
    results = []
    for step in range(STEPS):
        tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(100 * step + groups.dp.rank))
        loss = model(tokens, tokens, reduction="mean")
        loss.backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        tokens_per_expert = model.moe_metrics.tokens.clone()
        model.moe_metrics.reset()
        results.append((loss.item(), grads, tokens_per_expert, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return results


def _compiled_like_eager(ep_size: int, dispatcher: str):
    eager = _steps(ep_size, dispatcher, compiled=False)
    compiled = _steps(ep_size, dispatcher, compiled=True)
    for (loss, grads, counts, _), (closs, cgrads, ccounts, _) in zip(eager, compiled):
        assert abs(closs - loss) <= 1e-5 * abs(loss)
        assert torch.equal(counts, ccounts)  # the same routing
        for name, grad in grads.items():
            torch.testing.assert_close(cgrads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    graphs = [step[3] for step in compiled]
    return graphs, [step[2] for step in compiled]


@pytest.mark.parametrize("world,dispatcher", [pytest.param(1, "alltoall", marks=pytest.mark.product),
                                              pytest.param(2, "alltoall", marks=pytest.mark.product),  # 30 s compiling
                                              pytest.param(2, "allgather", marks=pytest.mark.product)],
                         ids=["ep1", "ep2-alltoall", "ep2-allgather"])
def test_compiled_moe_layers_match_eager_and_compile_once(world, dispatcher):
    for graphs, counts in run_ranks(world, _compiled_like_eager, world, dispatcher, deadline=300):
        assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, graphs
        assert len({tuple(c.flatten().tolist()) for c in counts}) == STEPS  # each step routed other split sizes


@pytest.mark.product
@pytest.mark.parametrize("world,flags", [
    (2, ["--expert-model-parallel-size", "2"]),
    (4, LLAMA + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-load-balancing-type", "seq_aux_loss"]),
], ids=["ep2", "llama-tp2-sp-ep2-bias-seq_aux"])
def test_compiled_moe_run_through_the_cli_matches_eager(world, flags):
    """The whole run (the auxiliary losses' backward scale, the expert bias, the log's figures) compiled: the eager
    run's losses and gradient norms; at TP 2 the counts' all-reduces run eagerly inside the compiled layers."""
    argv = BASE + ["--train-iters", "3", "--eval-iters", "0"] + flags
    eager = run_ranks(world, quiet_main, argv)[0]
    compiled = run_ranks(world, quiet_main, argv + ["--torch-compile"], deadline=300)[0]
    assert_close_lists(compiled["losses"], eager["losses"])
    assert_close_lists(compiled["grad_norms"], eager["grad_norms"])


def test_moe_layers_compile_layer_by_layer():
    # the dispatch's eager region would split a one-region trunk at every MoE layer: each layer compiles alone
    assert _config(True, "alltoall").trunk_eager_reason(1) == "mixture-of-experts layers dispatch their tokens eagerly"
