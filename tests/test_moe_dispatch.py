"""The token dispatchers (mpzero/moe/dispatch.py) on forked gloo ranks: at EP 2 and 4 each rank's outputs and
every gradient (its tokens', its experts' weights summed over every rank's tokens) equal one process's with all
the experts, with an expert that receives no token and uneven splits; the EP bytes counted on the group equal the
dispatcher's formula. Tolerance: fp32 sums of the same products in another order (the experts' weight gradients
summed over the ranks' rows), 1e-6."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpzero.comm import CommGroup
from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models.blocks import normal_init
from mpzero.moe import DISPATCHERS, GroupedExperts, MoEMetrics, drop_to_capacity, top_k
from mpzero.moe.dispatch import allgather, alltoall
from mpzero.parallel import init_parallel
from tests.distributed import run_ranks

H, F_, E, T, K = 8, 6, 8, 10, 2
TOL = dict(rtol=1e-6, atol=1e-6)


def _experts(experts: range) -> GroupedExperts:
    module = GroupedExperts(H, F_, experts, CommGroup(None, (0,), 0), normal_init(0.5), normal_init(0.5),
                            activation=F.silu, gated=True, bias=False, grouped_gemm=False)
    name_parameters(module, seed=1)
    materialize_module(module)
    return module


def _rank_inputs(rank: int, factor: float | None):
    """A rank's tokens and routing; expert 0 is never chosen, and rank 0 routes to the first half only."""
    generator = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randn(T, H, generator=generator)
    logits = torch.randn(T, E, generator=generator)
    logits[:, 0] = float("-inf")
    if rank == 0:
        logits[:, E // 2:] = float("-inf")
    probs, indices = top_k(logits.requires_grad_(), K, "softmax")  # gates with a gradient, as a router's
    return tokens, drop_to_capacity(probs, indices, E, factor)


def _run(dispatch, tokens, routing, experts, ep, metrics):
    x = tokens.clone().requires_grad_()
    out = dispatch(x, routing, experts, ep, E, metrics)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), x.grad


def _case(dispatcher: str, factor: float | None):
    world = dist.get_world_size()
    groups = init_parallel(1, ep_size=world)
    ep, rank, local = groups.ep, groups.ep.rank, E // world
    dispatch = {"alltoall": alltoall, "allgather": allgather}[dispatcher]
    tokens, routing = _rank_inputs(rank, factor)
    mine, metrics = _experts(range(rank * local, (rank + 1) * local)), MoEMetrics([True], E)
    out, grad = _run(dispatch, tokens, routing, mine, ep, metrics)
    assert ep.stats.total() == pytest.approx(metrics.ep_bytes)  # counted = the dispatcher's formula
    one = CommGroup(None, (0,), 0)
    whole = _experts(range(E))
    ref_out, ref_grad = _run(alltoall, *_rank_inputs(rank, factor), whole, one, None)  # a graph of its own
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    whole.zero_grad()  # the experts' gradients: every rank's tokens through one process's experts
    for r in range(world):
        _run(alltoall, *_rank_inputs(r, factor), whole, one, None)
    for name in ("weight1", "weight2"):
        torch.testing.assert_close(getattr(mine, name).grad, getattr(whole, name).grad[rank * local:(rank + 1) * local],
                                   **TOL)
    assert whole.weight1.grad[0].abs().sum() == 0  # expert 0 received no token anywhere
    return ep.stats.total()


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("world", [2, 4])
def test_dispatcher_matches_one_process(dispatcher, world):
    sent = run_ranks(world, _case, dispatcher, None)
    assert all(b > 0 for b in sent)


def test_capacity_dropped_slots_stay_home():
    run_ranks(2, _case, "alltoall", 0.5)
