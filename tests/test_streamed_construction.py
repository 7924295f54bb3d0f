"""Streamed construction (mpzero.deferred_init, mpzero.zero.construction) equals the whole build, bit for bit.

`pretrain_gpt.py` builds its model without storage and ZeroOptimizer makes it one bucket or unit at a time;
`GPTModel(..., device=...)` makes it whole. Both must start from the same weights at every layout (TP x DP x stage
x precision x offload tier), and train to the same losses, bitwise: the first 5 iterations are compared exactly.
`make test` runs a covering subset (every value of every axis, every pair of stage and tier); the whole product is
marked `product` and run by `.ci/run`."""

import contextlib
import io
import itertools

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from mpzero.cli.arguments import parse_args, run_config
from mpzero.models import GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_full
from mpzero.tensor_parallel.placement import placement_of
from mpzero.training import BuiltModel, build_training_state, train
from tests.cli import TINY
from tests.distributed import run_ranks
from tests.test_llama import LLAMA_FLAGS

FIVE = TINY + ["--train-iters", "5", "--eval-iters", "0", "--zero-bucket-numel", "3000", "--seed", "7"]


def whole_provider(config, groups, rng):
    model = GPTModel(config, groups.tp, rng, device=groups.device)
    return BuiltModel(model, config.flops_per_token(groups.tp_size), config.architecture())


def _argv(tp, dp, stage, precision, optimizer, params, offload_path):
    argv = FIVE + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage), "--micro-batch-size",
                   str(8 // dp)]
    if precision != "fp32":
        argv.append(f"--{precision}")
    if optimizer != "none":
        argv += ["--offload-optimizer", optimizer]
    if params != "none":
        argv += ["--offload-params", params]
    if "disk" in (optimizer, params):
        argv += ["--offload-path", offload_path]
    return argv


def _initial_and_losses(argv, streamed):
    """(the initial weights, gathered across TP and cut to their real size, on every rank; the losses)."""
    provider = pretrain_gpt.gpt_provider if streamed else whole_provider
    run = run_config(parse_args(argv), dist.get_world_size())
    groups = init_parallel(run.parallel.tensor_model_parallel_size)
    state = build_training_state(run, provider, groups)
    weights = {}
    for name, tensor in state.optimizer.consolidated_state_dict().items():
        placement = placement_of(name, dict(state.model.module.named_parameters())[name])
        full = gather_full(tensor, placement.partition_dim, groups.tp)
        if placement.unpadded_size is not None:
            full = full.narrow(placement.partition_dim, 0, placement.unpadded_size)
        weights[name] = full
    state.optimizer.close()
    with contextlib.redirect_stdout(io.StringIO()):
        history = train(run, provider)
    return weights, history["losses"]


@pytest.fixture(scope="module")
def reference():
    """The starting weights of one process, built whole, in fp32."""
    return run_ranks(1, _initial_and_losses, _argv(1, 1, 0, "fp32", "none", "none", ""), False)[0][0]


def _check_layout(reference, tmp_path, tp, dp, stage, precision, optimizer, params, family=()):
    streamed, whole = ([run_ranks(tp * dp, _initial_and_losses,
                                  _argv(tp, dp, stage, precision, optimizer, params, str(tmp_path / kind))
                                  + list(family), flag)[0]
                        for kind, flag in (("streamed", True), ("whole", False))])
    assert len(streamed[1]) == 5 and streamed[1] == whole[1]  # losses, bitwise
    if family:  # another architecture: its own starting weights, the same in both builds
        assert all(torch.equal(streamed[0][name], values) for name, values in whole[0].items())
        return
    for name, values in reference.items():  # the same starting weights at every layout, in fp32
        assert torch.equal(streamed[0][name], values), name
        assert torch.equal(whole[0][name], values), name


TIERS = {0: [("none", "none")], 1: [("none", "none"), ("cpu", "none"), ("disk", "none")],
         2: [("none", "none"), ("cpu", "none"), ("disk", "none")],
         3: [("none", "none"), ("cpu", "none"), ("disk", "none"), ("cpu", "cpu"), ("disk", "disk")]}
# every value of every axis, every (stage, tier) pair, at most 4 ranks
COVERING = [(1, 1, 0, "fp32", "none", "none"), (2, 2, 0, "bf16", "none", "none"),
            (1, 2, 1, "fp32", "none", "none"), (2, 2, 1, "bf16", "cpu", "none"), (1, 4, 1, "fp32", "disk", "none"),
            (2, 2, 2, "bf16", "none", "none"), (1, 4, 2, "bf16", "cpu", "none"), (2, 1, 2, "fp32", "disk", "none"),
            (2, 1, 3, "bf16", "none", "none"), (1, 4, 3, "fp32", "cpu", "none"), (2, 2, 3, "bf16", "disk", "none"),
            (1, 2, 3, "fp32", "cpu", "cpu"), (2, 2, 3, "bf16", "disk", "disk"), (1, 1, 3, "bf16", "cpu", "cpu")]


@pytest.mark.parametrize("tp,dp,stage,precision,optimizer,params", COVERING)
def test_streamed_build_equals_whole_build(reference, tmp_path, tp, dp, stage, precision, optimizer, params):
    _check_layout(reference, tmp_path, tp, dp, stage, precision, optimizer, params)


PRODUCT = [(tp, dp, stage, precision, optimizer, params)
           for tp, dp, stage, precision in itertools.product((1, 2), (1, 2, 4), (0, 1, 2, 3), ("fp32", "bf16"))
           for optimizer, params in TIERS[stage] if tp * dp <= 8]


@pytest.mark.product
@pytest.mark.parametrize("tp,dp,stage,precision,optimizer,params", PRODUCT)
def test_streamed_build_equals_whole_build_everywhere(reference, tmp_path, tp, dp, stage, precision, optimizer,
                                                     params):
    _check_layout(reference, tmp_path, tp, dp, stage, precision, optimizer, params)


def test_streamed_llama_equals_whole_build(reference, tmp_path):
    """The LLaMA family's blocks (RMSNorm, SwiGLU's [gate; up] halves, a copied row-parallel part, GQA) stream too."""
    _check_layout(reference, tmp_path, 2, 2, 3, "bf16", "cpu", "none", family=LLAMA_FLAGS)
