"""Global grad norm over TP x DP, consolidated export, and the layout-independent optimizer state."""

import pytest
import torch
from torch import nn

from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import RanksFailed, run_ranks
from tests.zero_toy import make_batches, make_model


class _TPToy(nn.Module):
    """loss = |x W^T|^2 + sum(b^2) * mean(x), W's rows split across TP (tensor_parallel), b replicated:
    each TP rank's loss term for W is its rows' share and b's gradient is the same on every TP rank."""

    def __init__(self, tp_rank, tp_size):
        super().__init__()
        torch.manual_seed(0)
        weight, bias = torch.randn(6, 5), torch.randn(5)
        self.weight = nn.Parameter(weight.chunk(tp_size)[tp_rank].clone())
        self.weight.tensor_parallel, self.weight.partition_dim = True, 0
        self.bias = nn.Parameter(bias)

    def forward(self, x):
        return (x @ self.weight.t()).pow(2).sum() + self.bias.pow(2).sum() * x.mean()


def _tp_norm(stage, tp_size):
    groups = init_parallel(tp_size=tp_size)
    model = _TPToy(groups.tp_rank, tp_size)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(clip_grad=0.0), PrecisionConfig())
    x = torch.randn(groups.dp_size, 3, 5, generator=torch.Generator().manual_seed(2))
    opt.backward(model(x[groups.dp_rank]), last_micro_batch=True)
    return opt.step().grad_norm


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_norm_matches_unsharded_model_norm(stage):
    full = _TPToy(0, 1)
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    (sum(full(x[r]) for r in range(2)) / 2).backward()
    expected = torch.linalg.vector_norm(torch.cat([full.weight.grad.flatten(), full.bias.grad])).item()
    for norm in run_ranks(4, _tp_norm, stage, 2):  # TP 2 x DP 2
        assert norm == pytest.approx(expected, rel=1e-6)  # fp32 sums of squares in another order


def _train(stage, steps, state=None, dp_first=None):
    """Trains `steps` iterations (1 micro-batch each), optionally after loading `state` saved at
    DP size `dp_first`; returns (consolidated weights, optimizer state) on every rank."""
    groups = init_parallel(tp_size=1)
    model = make_model()
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=300), AdamConfig(lr=1e-2, clip_grad=0.0, impl="torch"),
                        PrecisionConfig())
    batches = make_batches(4, 1, groups.dp_size)
    if state is not None:
        opt.load_state_dict(state)
        batches = batches[state["iteration"]:]
    for step_batches in batches[:steps]:
        opt.backward(model(*step_batches[0][groups.dp_rank]).mean(), last_micro_batch=True)
        opt.step()
    return opt.consolidated_state_dict(), opt.state_dict()


def test_zero_state_dict_resumes_at_another_stage_matches_uninterrupted_run():
    expected, _ = run_ranks(2, _train, 1, 4)[0]
    _, saved = run_ranks(2, _train, 1, 2)[0]
    for stage in (0, 2, 3):
        for weights, _ in run_ranks(2, _train, stage, 2, saved):
            for name, value in expected.items():
                assert torch.equal(weights[name], value), (stage, name)  # one micro-batch: same arithmetic


def test_zero_state_dict_loads_at_another_dp_size():
    _, saved = run_ranks(2, _train, 2, 2)[0]
    for weights, state in run_ranks(4, _train, 3, 0, saved):
        assert state["step"] == saved["step"] == 2 and state["loss_scaler"] == saved["loss_scaler"]
        for name, tensors in saved["params"].items():
            assert torch.equal(weights[name], tensors["master"])
            for key, value in tensors.items():
                assert torch.equal(state["params"][name][key], value), (name, key)
        frozen = make_model().position_embeddings.weight  # frozen: exported as it was built
        assert torch.equal(weights["position_embeddings.weight"], frozen.detach())


def _load_foreign_state():
    groups = init_parallel(tp_size=1)
    opt = ZeroOptimizer(make_model(), groups, ZeroConfig(), AdamConfig(), PrecisionConfig())
    opt.load_state_dict({"step": 0, "params": {}, "loss_scaler": {"scale": 1.0}, "iteration": 0})


def test_zero_state_of_another_model_is_a_one_line_config_error():
    with pytest.raises(RanksFailed, match=r"ConfigError: optimizer state has no entry for parameters \['"):
        run_ranks(1, _load_foreign_state)
