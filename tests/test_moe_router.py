"""The router (mpzero/moe/router.py): logits in fp32 (fp64 when asked) from any activation dtype, and the expert bias
of aux-loss-free balancing moved after a step by rate x sign(mean - tokens), the tokens summed over the step's
micro-batches and the data-parallel ranks (forked gloo ranks), then counted again from zero."""

import pytest
import torch

from mpzero.comm import CommGroup
from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models.blocks import normal_init
from mpzero.moe import TopKRouter
from mpzero.parallel import init_parallel
from tests.distributed import run_ranks

ONE = CommGroup(None, (0,), 0)


def _router(dtype=None, bias=True):
    router = TopKRouter(8, 4, normal_init(0.5), dtype, bias, None)
    name_parameters(router, seed=0)
    materialize_module(router)
    return router


@pytest.mark.parametrize("dtype,expected", [(None, torch.float32), ("fp32", torch.float32), ("fp64", torch.float64)])
def test_logits_in_the_routers_dtype(dtype, expected):
    router = _router(dtype, bias=False)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = router(x)
    assert logits.dtype == expected
    torch.testing.assert_close(logits, x.to(expected) @ router.weight.to(expected).t())


def _reference_update(bias: list[float], counts: list[int], rate: float) -> list[float]:
    mean = sum(counts) / len(counts)
    return [b + rate * ((mean > c) - (mean < c)) for b, c in zip(bias, counts)]


def test_expert_bias_moves_toward_the_under_used_experts():
    router = _router()
    for counts in ([5, 1, 3, 3], [2, 2, 4, 0]):  # two micro-batches of one step
        router.count(torch.tensor(counts))
    router.update_expert_bias(0.1, ONE)
    assert router.expert_bias.tolist() == pytest.approx(_reference_update([0.0] * 4, [7, 3, 7, 3], 0.1))
    assert router.step_tokens.tolist() == [0, 0, 0, 0]
    router.count(torch.tensor([1, 1, 1, 1]))  # equal counts: no move
    router.update_expert_bias(0.1, ONE)
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, -0.1, 0.1])
    assert "expert_bias" in router.state_dict() and "step_tokens" not in router.state_dict()


def _data_parallel_update():
    dp = init_parallel(1).dp
    router = _router()
    router.count(torch.tensor([[6, 0, 1, 1], [0, 2, 2, 4]][dp.rank]))
    router.update_expert_bias(1e-3, dp)
    return router.expert_bias.tolist()


def test_expert_bias_counts_every_data_parallel_ranks_tokens():
    biases = run_ranks(2, _data_parallel_update)
    assert biases[0] == biases[1] == pytest.approx(_reference_update([0.0] * 4, [6, 2, 3, 5], 1e-3))
