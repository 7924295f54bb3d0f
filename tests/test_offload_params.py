"""Stage 3 with its parameter shards in host memory or on disk (ZeRO-Infinity's parameter offload, issue 10 item 3):
training is bit for bit the in-memory stage-3 run (only where the shards rest changes); between steps the device
holds no parameter bytes; the in-step peak is the in-memory one plus the staging the formula states; reads are
issued ahead of use and counted. The tier on its own: tests/test_offload_param_tier.py."""

import multiprocessing as mp
import os

import pytest
import torch

from mpzero.zero.offload.params import SLOTS
from mpzero.zero.offload.swap import aligned_bytes, round_up
from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, OffloadConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from mpzero.storages import unique_storage_bytes
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model

STEPS, MICRO, LAYERS = 10, 2, 3
# (params tier, optimizer tier, prefetch): the optimizer must be offloaded too; one run keeps both on disk
VARIANTS = [("cpu", "cpu", True), ("cpu", "cpu", False), ("disk", "cpu", True), ("disk", "disk", False)]


def _train(dtype, params="none", optimizer="none", prefetch=True, recompute=False, path=None, probe=None):
    """Trains the toy on this rank; returns (losses, fp32 weights, loss of a forward after the last step)."""
    groups = init_parallel(tp_size=1)
    model = make_model(num_layers=LAYERS, recompute=recompute)
    model.to(groups.device, PrecisionConfig(dtype).torch_dtype)
    offload = None
    if optimizer != "none":
        disk = "disk" in (params, optimizer)
        offload = OffloadConfig(optimizer=optimizer, params=params, path=path if disk else None)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3, prefetch=prefetch),
                        AdamConfig(lr=1e-2, weight_decay=0.1, impl="torch"), PrecisionConfig(dtype), offload=offload)
    losses, moved = [], [opt.stage.transfers()]
    for step_batches in make_batches(STEPS, MICRO, groups.dp_size):
        for m, micro_batch in enumerate(step_batches):
            loss = model(*(t.to(groups.device) for t in micro_batch[groups.dp_rank])).mean() / MICRO
            losses.append(loss.detach().cpu())
            opt.backward(loss, last_micro_batch=m == MICRO - 1)
        opt.step()
        if probe:
            probe(opt, moved)
    with torch.no_grad():
        batch = make_batches(1, 1, groups.dp_size, seed=7)[0][0][groups.dp_rank]
        final = model(*(t.to(groups.device) for t in batch)).mean().cpu()
    weights = {name: value.cpu() for name, value in opt.consolidated_state_dict().items()}
    opt.close()
    return losses, weights, final


def _between_steps(opt, moved):
    """After a step the device holds nothing: no parameter shard, gathered unit or staging, and the gradient
    shards are in host memory (streamed there in backward with the optimizer offloaded, issue 24), or in the
    gradient file with the optimizer on disk; the step fetched every unit's shard twice per micro-batch (forward,
    backward), from the disk tier by one aligned read each, and wrote each unit's region once; the gradient file
    had each unit's region written every micro-batch and read by the next one and by the step."""
    stage = opt.stage
    held = unique_storage_bytes(stage.held_tensors())
    grad_file = stage.gradient_file
    assert held == 0 and (grad_file is not None and not stage.grad_shards
                          or {g.device.type for g in stage.grad_shards} == {"cpu"}), held
    assert stage.meter.current == 0 and not stage.tier.staging()
    step, p = stage.transfers() - moved[-1], stage.tier.dtype.itemsize
    moved.append(stage.transfers())
    shards = sum(p * layout.shard_numel for layout in stage.layouts)
    regions = sum(round_up(p * layout.shard_numel) for layout in stage.layouts)
    grad_bytes = sum(stage.grads._dtype.itemsize * layout.shard_numel for layout in stage.layouts)
    grad_regions = sum(grad_file.regions) if grad_file is not None else 0
    on_gpu = stage.tier.device.type == "cuda"
    streamed = MICRO * grad_bytes  # every micro-batch's reduced gradient slices
    assert step.host_to_device == (2 * MICRO * shards if on_gpu else 0), step
    assert step.device_to_host == (streamed if on_gpu else 0), step
    disk = stage.tier.kind == "disk"
    params_io = (2 * MICRO * regions, regions) if disk else (0, 0)
    assert (step.disk_read, step.disk_written) == (params_io[0] + MICRO * grad_regions,
                                                   params_io[1] + MICRO * grad_regions), step


def _all_variants(dtype, path):
    results = {}
    for recompute in (False, True):
        results["memory", recompute] = _train(dtype, recompute=recompute)
        results["optimizer only", recompute] = _train(dtype, optimizer="cpu", recompute=recompute)
        for params, optimizer, prefetch in VARIANTS:
            folder = os.path.join(path, f"{params}-{optimizer}-{prefetch}-{recompute}")
            results[params, optimizer, prefetch, recompute] = _train(
                dtype, params, optimizer, prefetch, recompute, folder, probe=_between_steps)
    return results


def _check_bitwise(per_rank: list, tmp_path, baseline: str = "memory") -> None:
    """Every run equals the baseline with the same recompute setting, bit for bit."""
    for rank, results in enumerate(per_rank):
        for key, (losses, weights, final) in results.items():
            if key[0] == "memory" and baseline != "memory":
                continue
            base_losses, base_weights, base_final = results[baseline, key[-1]]
            assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), (rank, key)
            assert all(torch.equal(weights[name], base_weights[name]) for name in base_weights), (rank, key)
            assert torch.equal(final, base_final), (rank, key)
    assert not any(files for _, _, files in os.walk(tmp_path))  # close() removed every offload file


@pytest.mark.parametrize("dp,dtype", [(1, "fp32"), (1, "bf16"), (2, "fp32"),
                                      pytest.param(2, "bf16", marks=pytest.mark.product)])
def test_offloaded_params_train_bit_for_bit_as_in_memory(dp, dtype, tmp_path):
    _check_bitwise(run_ranks(dp, _all_variants, dtype, str(tmp_path), deadline=300), tmp_path)


def _world_of_one(fn, *args):
    """fn(*args) in a fresh process (spawned: CUDA does not survive a fork) in an NCCL world of one."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_offloaded_params_train_bit_for_bit_as_in_memory(dtype, tmp_path):
    """On the GPU: shards fetched by pinned host-to-device copies on a side stream, counted, bitwise. The
    baseline offloads the optimizer alone (AdamW on the CPU: the in-memory run's AdamW on the GPU rounds
    differently), so only where the parameter shards rest differs."""
    _check_bitwise([_world_of_one(_all_variants, dtype, str(tmp_path))], tmp_path, baseline="optimizer only")


def _measure(params, dtype, prefetch, layers, path):
    """Peak, traffic and the reads served ahead, over 3 steps; the tier's holdings."""
    groups = init_parallel(tp_size=1)
    model = make_model(num_layers=layers)
    precision = PrecisionConfig(dtype)
    model.to(precision.torch_dtype)
    offload = OffloadConfig(optimizer="cpu", params=params, path=path if params == "disk" else None)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3, prefetch=prefetch), AdamConfig(), precision,
                        offload=offload)
    stage, tier = opt.stage, opt.stage.tier
    served_ahead, fetch = [], tier.fetch

    def counting_fetch(u, into=None):
        served_ahead.append(tier._slot_of(u) is not None)
        return fetch(u, into)
    tier.fetch = counting_fetch
    staged = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: staged.append(len(tier.staging())))
    traffic = []
    for step_batches in make_batches(3, 1, groups.dp_size):
        served_ahead.clear()
        before = stage.transfers()
        opt.backward(model(*step_batches[0][groups.dp_rank]).mean(), last_micro_batch=True)
        opt.step()
        traffic.append(stage.transfers() - before)
    shards = {"is_host": stage.param_shards is tier.param_shards,
              "devices": {t.device.type for t in stage.param_shards}}
    result = dict(peak=stage.meter.peak, working=stage.peak_working_set(precision.torch_dtype.itemsize, 4),
                  traffic=traffic[-1], served_ahead=list(served_ahead), staged=max(staged), shards=shards,
                  tier=stage.tier_bytes(), buffers=stage.host_buffer_formula(),
                  numels=[(layout.padded_numel, layout.shard_numel) for layout in stage.layouts])
    opt.close()
    return result


@pytest.mark.parametrize("params", ["cpu", "disk"])
def test_offloaded_params_peak_staging_traffic_and_holdings(params, tmp_path):
    layers, p, g = 4, 2, 4  # bf16 parameters, fp32 gradients
    for dp, prefetch in ((2, True), (2, False), (1, True)):
        for rank, r in enumerate(run_ranks(dp, _measure, params, "bf16", prefetch, layers, str(tmp_path / str(dp)))):
            (root, _), (layer, shard) = r["numels"][0], r["numels"][1]
            # At a middle layer of backward: the root and its gradient bucket, that layer and the next one
            # gathered, that layer's bucket and the previous one's in flight; staged at DP > 1 with prefetch:
            # the next layer's shard (its gather in flight) and the one after it (read ahead).
            # Gradients streamed to the host (issue 24) add the reduced slices on their way, g x shard at layer j
            # of backward for each of the previous two layers (being reduced, being copied).
            ahead = [(j < layers - 1) + (j < layers - 2) if dp > 1 and prefetch else 0 for j in range(layers)]
            slices = max(p * a + g * min(j, 2) for j, a in enumerate(ahead)) * shard
            expected = (p + g) * root + ((2 * p + 2 * g) if prefetch else (p + 2 * g)) * layer + slices
            assert r["peak"] == r["working"][0] == expected, (dp, prefetch, r["peak"], r["working"])
            assert r["staged"] <= SLOTS
            # Every fetch but the first of each pass (forward, backward) was read ahead (the cpu tier at DP 1
            # copies straight into the full buffer: nothing to read ahead).
            reads_ahead = prefetch and (dp > 1 or params == "disk")
            assert sum(r["served_ahead"]) == (2 * (layers - 1) if reads_ahead else 0), (dp, prefetch, r["served_ahead"])
            # Per step: every unit read twice (forward, backward) and written once; on a CPU run nothing
            # crosses to a device.
            regions = sum(round_up(p * n) for _, n in r["numels"])
            if params == "disk":
                assert (r["traffic"].disk_read, r["traffic"].disk_written) == (2 * regions, regions)
                grads = g * sum(n for _, n in r["numels"])  # the gradient partition, streamed to host memory
                assert r["tier"].disk == regions and r["tier"].host == grads
                largest = max(n for _, n in r["numels"])
                assert r["tier"].host_buffers == r["buffers"][0] == SLOTS * aligned_bytes(largest, torch.bfloat16)
                assert r["shards"]["devices"] == {"meta"}  # shape and dtype only: the values are in the file
            else:
                assert r["traffic"].disk_read == r["traffic"].disk_written == 0
                assert r["tier"].host == sum((p + g) * n for _, n in r["numels"]) and r["tier"].host_buffers == 0
                assert r["shards"] == {"is_host": True, "devices": {"cpu"}}
            assert r["traffic"].host_to_device == 0
