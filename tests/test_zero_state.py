"""Global grad norm over TP x DP, consolidated export, the layout-independent optimizer state (through the
checkpoint, its one format), and the placement contract: an unmarked parameter is refused."""

import pytest
import torch
from torch import nn

from mpzero.checkpointing import load_checkpoint, save_checkpoint
from mpzero.errors import ConfigError
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import RNGStatesTracker, mark_tensor_parallel
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
        self.weight = mark_tensor_parallel(nn.Parameter(weight.chunk(tp_size)[tp_rank].clone()), 0)
        self.bias = mark_tensor_parallel(nn.Parameter(bias), None)

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


def _train(stage, steps, load_from=None, save_to=None):
    """Trains `steps` iterations (1 micro-batch each), after loading the checkpoint in `load_from` if given,
    then saves into `save_to` if given; returns (consolidated weights, optimizer pieces) on every rank."""
    groups = init_parallel(tp_size=1)
    model = make_model()
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=300),
                        AdamConfig(lr=1e-2, clip_grad=0.0, impl="torch"), PrecisionConfig())
    rng = RNGStatesTracker(groups.device)
    batches = make_batches(4, 1, groups.dp_size)
    if load_from is not None:
        meta = load_checkpoint(load_from, model, opt, rng, groups)
        batches = batches[meta["iteration"]:]
    for step_batches in batches[:steps]:
        opt.backward(model(*step_batches[0][groups.dp_rank]).mean(), last_micro_batch=True)
        opt.step()
    if save_to is not None:
        save_checkpoint(save_to, opt.iteration, model, opt, rng, groups, {})
    return opt.consolidated_state_dict(), _full_state(model, opt, groups)


def _full_state(model, opt, groups):
    """{(name, state): full tensor} assembled from every DP rank's owned pieces (summed over DP: the pieces
    are disjoint, except at stage 0 where every rank owns everything)."""
    full = {(name, key): torch.zeros(p.numel()) for name, p in model.named_parameters() if p.requires_grad
            for key in ("master", "exp_avg", "exp_avg_sq")}
    for piece in opt.owned_pieces():
        for key, tensor in piece.tensors.items():
            full[piece.name, key][piece.start:piece.end] += tensor
    if opt.zero.stage > 0:
        for flat in full.values():
            groups.dp.all_reduce(flat)
    return full, opt.adam_step()


def test_zero_checkpoint_resumes_at_another_stage_matches_uninterrupted_run(tmp_path):
    expected, _ = run_ranks(2, _train, 1, 4)[0]
    run_ranks(2, _train, 1, 2, None, str(tmp_path))
    for stage in (0, 2, 3):
        for weights, _ in run_ranks(2, _train, stage, 2, str(tmp_path)):
            for name, value in expected.items():
                assert torch.equal(weights[name], value), (stage, name)  # one micro-batch: same arithmetic


def test_zero_checkpoint_loads_at_another_dp_size(tmp_path):
    saved_weights, (saved, saved_step) = run_ranks(2, _train, 2, 2, None, str(tmp_path))[0]
    for weights, (state, step) in run_ranks(4, _train, 3, 0, str(tmp_path)):
        assert step == saved_step == 2
        assert state.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(state[key], value), key
        for name, value in saved_weights.items():
            assert torch.equal(weights[name], value), name
        frozen = make_model().position_embeddings.weight  # frozen: exported as it was built
        assert torch.equal(weights["position_embeddings.weight"], frozen.detach())


def _load_other_model(root):
    groups = init_parallel(tp_size=1)
    model = make_model(num_layers=1)
    opt = ZeroOptimizer(model, groups, ZeroConfig(), AdamConfig(), PrecisionConfig())
    load_checkpoint(root, model, opt, RNGStatesTracker(groups.device), groups)


def test_zero_checkpoint_of_another_model_is_a_one_line_config_error(tmp_path):
    run_ranks(1, _train, 1, 1, None, str(tmp_path))
    with pytest.raises(RanksFailed, match=r"ConfigError: .* is from another model: layers.1.fc1.bias is \(23,\) there and absent here"):
        run_ranks(1, _load_other_model, str(tmp_path))


class _PartlyMarked(nn.Module):
    def __init__(self):
        super().__init__()
        self.marked = mark_tensor_parallel(nn.Parameter(torch.zeros(3)), None)
        self.proj = nn.Linear(3, 2)  # never marked


def _optimizer_of_a_partly_marked_module():
    ZeroOptimizer(_PartlyMarked(), init_parallel(tp_size=1), ZeroConfig(), AdamConfig(), PrecisionConfig())


def test_an_unmarked_parameter_is_refused_at_construction():
    with pytest.raises(RanksFailed, match=r"ConfigError: parameter 'proj.weight' does not say how it is split "
                                          r"across tensor-parallel ranks"):
        run_ranks(1, _optimizer_of_a_partly_marked_module)


def test_a_partition_dim_outside_the_shape_is_refused():
    with pytest.raises(ConfigError, match="partition_dim 2 is not a dimension of a 2-D parameter"):
        mark_tensor_parallel(nn.Parameter(torch.zeros(2, 3)), 2)
