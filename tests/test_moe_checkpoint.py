"""Mixture-of-experts weights independent of the layout: the initial weights at EP 2 and 4 (and expert-TP 2) are one
process's bit for bit, each expert drawn from its global name; a checkpoint saved at EP 2 resumes at EP 1 and EP 4
with the uninterrupted run's losses, the routers' expert bias included (forked gloo ranks, fp32, dropout off)."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from mpzero.checkpointing import latest_iteration
from mpzero.cli.arguments import parse_args, run_config
from mpzero.training import build_training_state
from pretrain_gpt import _provider
from tests.cli import assert_close_lists, quiet_main
from tests.distributed import run_ranks
from tests.test_moe_layouts import BASE, LLAMA, ep

EXPERTS = ".mlp.experts."


def _initial_weights(argv):
    run = run_config(parse_args(argv), dist.get_world_size())
    groups = run.parallel.join()
    state = build_training_state(run, _provider(run), groups)
    weights = state.optimizer.consolidated_state_dict()
    state.optimizer.close()
    return groups.ep.rank, groups.expert_tp.rank, groups.tp.rank, weights


def _merged(ranks) -> dict[str, torch.Tensor]:
    """One process's tensors from every EP rank's experts (expert-TP rank 0's; TP 1 here)."""
    merged, stacks = {}, {}
    for ep_rank, etp_rank, tp_rank, weights in ranks:
        for name, tensor in weights.items():
            if EXPERTS in name:
                stacks.setdefault(name, {})[ep_rank] = tensor
            else:
                merged[name] = tensor
    for name, parts in stacks.items():
        merged[name] = torch.cat([parts[r] for r in sorted(parts)])
    return merged


@pytest.mark.parametrize("world,model,layout", [(2, [], ep(2)), (4, LLAMA, ep(4, "--zero-stage", "3"))],
                         ids=["gpt-ep2", "llama-ep4-zero3"])
def test_initial_weights_at_every_ep_size_are_one_processs(world, model, layout):
    whole = run_ranks(1, _initial_weights, BASE + model)[0][3]
    merged = _merged(run_ranks(world, _initial_weights, BASE + model + layout))
    assert sorted(merged) == sorted(whole)
    assert all(torch.equal(merged[name], whole[name]) for name in whole), [
        name for name in whole if not torch.equal(merged[name], whole[name])]
    assert whole["layers.0.mlp.experts.weight1"].shape[0] == 4


def test_a_checkpoint_moves_between_ep_sizes(tmp_path):
    """Saved at EP 2 x DP 2 (ZeRO-1) with the expert bias moving, resumed at EP 1 and EP 4: the uninterrupted run's
    losses. The expert stacks are stored by global expert index; the bias rides in the meta."""
    argv = BASE + ["--train-iters", "5", "--eval-iters", "0", "--moe-router-score-function", "sigmoid",
                   "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2"]
    saved = argv + ep(2, "--zero-stage", "1")
    uninterrupted = run_ranks(2, quiet_main, saved)[0]
    # saved after an odd number of steps: a bias of +-rate steps is then nonzero
    run_ranks(2, quiet_main, saved + ["--save", str(tmp_path), "--exit-interval", "3"])
    directory = os.path.join(str(tmp_path), f"iter_{latest_iteration(str(tmp_path)):07d}")
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    assert meta["shapes"]["model/layers.0.mlp.experts.weight1"] == [4, 16, 32]  # [E, f, h]
    assert sorted(meta["moe_expert_bias"]) == ["layers.0.mlp.router", "layers.1.mlp.router"]
    assert any(v != 0 for bias in meta["moe_expert_bias"].values() for v in bias)
    for world, layout in ((1, []), (4, ep(4))):
        resumed = run_ranks(world, quiet_main, argv + layout + ["--load", str(tmp_path)])[-1]
        assert_close_lists(resumed["losses"], uninterrupted["losses"][3:])
