"""Sequence parallelism (--sequence-parallel): TP 2 with SP trains like TP 2 without it and like one process
(fp32, no dropout: losses and gradient norms within 1e-5, also under ZeRO 1-3 with DP 2); the replicated
parameters used on sequence slices (LayerNorms, row-parallel biases) get bitwise the same gradient on both TP
ranks after the SP all-reduce (Megatron-LM#1446, gpt-neox#1257); checkpoints move between SP on and off."""

import dataclasses

import pytest
import torch

from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_full, placement_of, seed_everything
from tests.cli import TINY, assert_close_lists, quiet_main
from tests.distributed import run_ranks

SHORT = TINY + ["--train-iters", "6", "--eval-interval", "3"]


@pytest.fixture(scope="module")
def reference():
    return run_ranks(1, quiet_main, SHORT)[0]


def _assert_same_training(history, reference):
    for key in ("losses", "grad_norms", "valid_losses"):
        assert_close_lists(history[key], reference[key])


def test_sp_at_tp2_trains_like_tp2_without_sp_and_like_tp1(reference):
    """The tied output projection gathers the sequence from the final LayerNorm's slices (the untied one is in
    test_sp_gradients_equal_tp_gradients_without_dropout)."""
    tp2 = SHORT + ["--tensor-model-parallel-size", "2"]
    with_sp = run_ranks(2, quiet_main, tp2 + ["--sequence-parallel"])[0]
    without = run_ranks(2, quiet_main, tp2)[0]
    _assert_same_training(with_sp, without)
    _assert_same_training(with_sp, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sp_composes_with_zero_at_tp2_dp2(reference, stage):
    argv = SHORT + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", str(stage),
                    "--micro-batch-size", "1", "--zero-bucket-numel", "5000"]
    _assert_same_training(run_ranks(4, quiet_main, argv)[0], reference)


CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=300, max_position_embeddings=16,
                   hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=True,
                   untie_embeddings_and_output_weights=True)


def _sp_grads(config, dtype):
    groups = init_parallel(2)
    model = GPTModel(config, groups.tp, seed_everything(11, groups.tp_rank, groups.device)).to(dtype)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(2))
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    replicated = {name: p.grad for name, p in model.named_parameters() if placement_of(name, p).partition_dim is None}
    marked = sorted(name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    return replicated, marked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replicated_gradients_are_bitwise_equal_on_both_tp_ranks(dtype):
    """With dropout on, each rank sees another slice of the sequence and other masks: the LayerNorm and bias
    gradients differ before the SP all-reduce and are the same bits after it, on every replicated parameter."""
    (grads0, marked0), (grads1, marked1) = run_ranks(2, _sp_grads, CONFIG, dtype)
    assert marked0 == marked1
    assert {n.split(".")[-2] for n in marked0} == {"input_layernorm", "post_attention_layernorm", "final_layernorm",
                                                 "dense", "fc2"}
    assert len(marked0) == 2 * (2 * 2 + 2) + 2  # per layer 2 LayerNorms x (weight, bias) + 2 biases; final LN
    assert set(grads0) == set(grads1) == set(marked0) | {"embedding.position_embeddings.weight"}
    for name in grads0:
        assert grads0[name].abs().sum() > 0, name
        assert torch.equal(grads0[name], grads1[name]), name


def _tp2_grads(config):
    groups = init_parallel(2)
    model = GPTModel(config, groups.tp, seed_everything(11, groups.tp_rank, groups.device))
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(2))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: gather_full(p.grad, p.partition_dim, groups.tp) for n, p in model.named_parameters()}


def test_sp_gradients_equal_tp_gradients_without_dropout():
    no_dropout = dataclasses.replace(CONFIG, hidden_dropout=0.0, attention_dropout=0.0)
    sp = run_ranks(2, _tp2_grads, no_dropout)[0]
    plain = run_ranks(2, _tp2_grads, dataclasses.replace(no_dropout, sequence_parallel=False))[0]
    assert abs(sp[0] - plain[0]) <= 1e-6 * abs(plain[0])
    for name, grad in plain[1].items():
        torch.testing.assert_close(sp[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("saved,loaded", [(["--sequence-parallel"], []), ([], ["--sequence-parallel"])])
def test_checkpoints_move_between_sp_on_and_off(tmp_path, saved, loaded):
    argv = TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "4", "--eval-iters", "0"]
    uninterrupted = run_ranks(2, quiet_main, argv + loaded)[0]
    run_ranks(2, quiet_main, argv + saved + ["--save", str(tmp_path), "--exit-interval", "2"])
    resumed = run_ranks(2, quiet_main, argv + loaded + ["--load", str(tmp_path)])[0]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][2:])
    assert_close_lists(resumed["grad_norms"], uninterrupted["grad_norms"][2:])
