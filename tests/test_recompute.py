"""Recomputation replays exactly what it dropped: with dropout on, selective recomputation (the core attention),
full recomputation (uniform chunks, block), distributed checkpoints (1/t slices all-gathered for the replay) and
the host tier (save_on_cpu) give the same loss and gradients, bit for bit, as storing every activation, at TP 1
and 2 (with and without sequence parallelism); ZeRO stage 3's gather hooks re-enter in the replay (through the
CLI at TP 2 x DP 2, against the single-process losses and bitwise against no recomputation); the FLOPs formula
counts what is recomputed."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mpzero.activations import SavedBytesCounter, activation_formula
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from tests.cli import TINY, assert_close_lists, quiet_main
from tests.distributed import run_ranks

CONFIG = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=300, max_position_embeddings=16,
                   hidden_dropout=0.2, attention_dropout=0.3)
FULL = dict(recompute_granularity="full")
MODES = {"selective": dict(recompute_activations=True), "selective by name": dict(recompute_granularity="selective"),
         "full uniform 1": FULL, "full uniform 2": dict(FULL, recompute_num_layers=2),
         "full block 1": dict(FULL, recompute_method="block", recompute_num_layers=1),
         "full block 3": dict(FULL, recompute_method="block", recompute_num_layers=3)}
TP2_MODES = {"distributed": dict(FULL, distribute_saved_activations=True),
             "distributed uniform 2": dict(FULL, recompute_num_layers=2, distribute_saved_activations=True)}


def _loss_and_grads(groups, config, dtype=torch.float32):
    model = GPTModel(config, groups.tp, seed_everything(7, groups.tp_rank, groups.device)).to(dtype)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(4))
    counter = SavedBytesCounter(model)
    with counter.counting():
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    formula = activation_formula(model.activation_setting(2, 16, dtype, groups.device))
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, counter, formula


def _every_mode(tp, dtype):
    groups = init_parallel(tp)
    out = {}
    bases = {"": {}} if tp == 1 else {"": {}, "sp ": dict(sequence_parallel=True)}
    for prefix, base in bases.items():
        stored = _loss_and_grads(groups, dataclasses.replace(CONFIG, **base), dtype)[:2]
        modes = dict(MODES, **(TP2_MODES if tp == 2 and not prefix else {}))
        for mode, change in modes.items():
            loss, grads = _loss_and_grads(groups, dataclasses.replace(CONFIG, **base, **change), dtype)[:2]
            out[prefix + mode] = (torch.equal(loss, stored[0]),
                                  [n for n, g in stored[1].items() if not torch.equal(grads[n], g)])
    return out


@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_recomputation_is_bitwise_the_stored_run_with_dropout(tp, dtype):
    for rank, results in enumerate(run_ranks(tp, _every_mode, tp, dtype)):
        assert len(results) == (6 if tp == 1 else 14)
        for mode, (same_loss, differing) in results.items():
            assert same_loss and not differing, (rank, mode, differing)


def _host_tier(change):
    groups = init_parallel(2)
    config = dataclasses.replace(CONFIG, **change)
    loss, grads, _, _ = _loss_and_grads(groups, config)
    loss_h, grads_h, counter, formula = _loss_and_grads(groups, dataclasses.replace(config, offload_activations="cpu"))
    return (torch.equal(loss, loss_h), [n for n, g in grads.items() if not torch.equal(grads_h[n], g)],
            counter.layer_bytes(3), sum(counter.host_bytes.values()), [l.host_bytes for l in formula.layers])


@pytest.mark.parametrize("change", [dict(FULL, recompute_num_layers=2, distribute_saved_activations=True),
                                    dict(recompute_activations=True, sequence_parallel=True)])
def test_host_tier_keeps_saved_tensors_off_the_device_and_changes_nothing(change):
    """save_on_cpu packs the checkpoints (full recomputation: exactly the checkpoint formula's bytes) or every
    tensor the layers save (selective): nothing of the layers stays among the device's saved tensors."""
    for same_loss, differing, device_layers, host, host_formula in run_ranks(2, _host_tier, change):
        assert same_loss and not differing, differing
        assert device_layers == [0, 0, 0]
        if change.get("recompute_granularity") == "full":
            assert host == sum(host_formula) > 0
        else:
            assert host_formula == [None] * 3 and host > 0


@pytest.fixture(scope="module")
def reference():
    return run_ranks(1, quiet_main, TINY + ["--train-iters", "4", "--eval-iters", "0"])[0]


LAYOUT = TINY + ["--train-iters", "4", "--eval-iters", "0", "--tensor-model-parallel-size", "2",
                 "--micro-batch-size", "1", "--zero-bucket-numel", "5000"]


@pytest.mark.parametrize("stage,flags", [
    (1, ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]),
    (2, ["--recompute-activations", "--sequence-parallel"]),
    (3, ["--recompute-granularity", "full", "--recompute-num-layers", "2", "--distribute-saved-activations"]),
    (3, ["--recompute-activations"])])
def test_recomputation_composes_with_zero_at_tp2_dp2(reference, stage, flags):
    history = run_ranks(4, quiet_main, LAYOUT + ["--zero-stage", str(stage)] + flags)[0]
    assert_close_lists(history["losses"], reference["losses"])
    assert_close_lists(history["grad_norms"], reference["grad_norms"])


def test_zero3_replays_dropout_bitwise_through_the_cli():
    """Stage 3 re-gathers each unit inside the replay of a two-layer chunk; with dropout on, the run is the
    stored run bit for bit."""
    argv = LAYOUT + ["--zero-stage", "3", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    stored = run_ranks(4, quiet_main, argv)[0]
    recomputed = run_ranks(4, quiet_main, argv + ["--recompute-granularity", "full", "--recompute-num-layers", "2",
                                                  "--distribute-saved-activations"])[0]
    assert recomputed["losses"] == stored["losses"] and recomputed["grad_norms"] == stored["grad_norms"]


def _counted_flops(config):
    model = GPTModel(config, init_parallel(1).tp, seed_everything(1, 0, torch.device("cpu")))
    tokens = torch.randint(0, 300, (3, 13), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:], reduction="mean").backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("change", [dict(FULL), dict(FULL, recompute_num_layers=2),
                                    dict(FULL, recompute_method="block", recompute_num_layers=1),
                                    dict(recompute_activations=True)])
def test_flops_formula_counts_what_is_recomputed(change):
    config = dataclasses.replace(CONFIG, hidden_dropout=0.0, attention_dropout=0.0, seq_length=12,
                                 max_position_embeddings=12, attention_backend="local", **change)  # explicit matmuls
    assert run_ranks(1, _counted_flops, config)[0] == config.flops_per_token() * 3 * 12
