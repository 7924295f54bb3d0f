"""What a run does before its first iteration, before the model is built: the checks that fail first and on every
rank (every rank's view of --load, --save and --offload-path, sizes no machine holds, the nodes' shared
--save/--load, the checkpoint's meta and tokenizer, the data's tokenizers, the datasets'
paths), and the lines a run prints at start. `start` is the one call the loop makes here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from mpzero.activations import activation_formula
from mpzero.checkpointing import read_meta
from mpzero.data import build_gpt_datasets, check_checkpoint_tokenizer, check_data_tokenizers, parse_data_path
from mpzero.context_parallel import block_kernel
from mpzero.errors import ConfigError
from mpzero.fused import fused_attention_refusal, resolve_impl, resolved_impls
from mpzero.moe import experts_impl
from mpzero.nodes import check_nodes
from mpzero.parallel import ParallelGroups
from mpzero.path_views import check_same_views
from mpzero.scale import check_scale, machine_bytes
from mpzero.training.config import RunConfig
from mpzero.training.mock_data import MockGPTDataset
from mpzero.training.peak_flops import mfu_note, mfu_peak


def fused_ops(run: RunConfig, device: torch.device) -> dict[str, str]:
    """What `auto` runs on this device: each fused op's implementation; the model's attention backend and loss
    arithmetic as its flags choose them (--attention-backend, --cross-entropy-loss-fusion); the CUDA graphs it
    replays (--cuda-graph-impl)."""
    attention = run.model.attention(device)
    if run.model.cp_blockwise:
        kernel = block_kernel(run.model.attention_backend_name, torch.device(device).type)
        attention = f"context parallel {run.model.cp_comm_type}, {kernel} blocks"
    return {**resolved_impls(device), "attention": attention,
            "cross_entropy": resolve_impl("cross_entropy", device, run.model.cross_entropy_impl),
            "cuda_graphs": run.model.cuda_graphs(device),
            "fp8": run.model.fp8.describe() if run.model.fp8 is not None else "none",
            **({"moe_experts": experts_impl(run.model.moe_grouped_gemm)} if run.model.num_experts else {})}


def start(run: RunConfig, groups: ParallelGroups) -> tuple[tuple, dict]:
    """((train, valid, test) datasets, the data's tokenizers), checked before the model is built (bad data paths
    fail first), and the lines a run prints at start."""
    if run.profile.enabled and not run.profile.use_pytorch_profiler and groups.device.type != "cuda":
        raise ConfigError(f"--profile without --use-pytorch-profiler marks the window for Nsight Systems through the "
                          f"CUDA profiler API, and this run computes on the {groups.device.type}: add "
                          f"--use-pytorch-profiler (and --tensorboard-dir)")
    check_same_views(groups.world, run.flags)
    _check_scale(run, groups)
    if run.model.fp8 is not None and groups.device.type == "cuda" and torch.cuda.get_device_capability(
            groups.device) < (8, 9):
        raise ConfigError(f"--fp8-format: {torch.cuda.get_device_name(groups.device)} has no FP8 matmuls (they need "
                          f"compute capability 8.9 or newer: Ada, Hopper, Blackwell): drop --fp8-format")
    attention_line = _check_fused_attention(run, groups)
    nodes_line = check_nodes(groups.world, groups.sizes, run.checkpoint.save, run.checkpoint.load)
    resumed = _resume_point(run, groups)
    data_tokenizers, data_notes = _data_tokenizers(run, groups)
    datasets = _datasets(run, groups, resumed)
    if groups.is_logging_rank:
        print("configuration: " + json.dumps(run.flags, sort_keys=True), flush=True)
        print("fused ops (auto): " + json.dumps(fused_ops(run, groups.device), sort_keys=True), flush=True)
        if nodes_line:
            print(nodes_line, flush=True)
        mfu_line = mfu_note(mfu_peak(groups.device, run.precision.dtype))
        notes = [line for line in (mfu_line, attention_line) if line] + _resume_notes(run, resumed) + data_notes
        for note in notes:
            print(note, flush=True)
    return datasets, data_tokenizers


def _check_scale(run: RunConfig, groups: ParallelGroups) -> None:
    """Sizes no machine holds (`--ffn-hidden-size 1000000000000`) are one line from the planner's arithmetic
    (mpzero/scale.py) before anything is built; every rank computes the same figure."""
    config, precision = run.model, run.precision
    p, g = precision.torch_dtype.itemsize, precision.grad_dtype.itemsize  # as ZeroOptimizer sizes its elements

    def activations() -> int:  # one micro-batch's, where the formula covers the setting (else counted as none)
        if groups.pp_size > 1 or groups.cp.size > 1:
            return 0  # the formula is the whole model's at full sequence length: no lower bound for one stage
        try:
            return activation_formula(config.activation_setting(
                groups.tp_size, run.training.micro_batch_size, run.training.seq_length, precision.torch_dtype,
                groups.device)).micro_batch_bytes
        except (ValueError, ArithmeticError):
            return 0

    check_scale(config, groups.tp_size, groups.dp_cp.size, run.zero.stage,
                (p, g, 4 if p != 4 else 0, run.optimizer.rule.state_bytes_per_param), activations,
                machine_bytes(groups.device.type, run.offload.path), groups.pp_size)


def _check_fused_attention(run: RunConfig, groups: ParallelGroups) -> str | None:
    """Asks torch once whether one of its fused attention kernels runs this rank's attention, where the model's
    backend is flash or fused; without one, F.scaled_dot_product_attention would take its math path silently. Every
    rank asks on its own device and the ranks share the answers. A GPU run then stops on torch's reasons. A CPU run
    gets a note instead: SDPA's CPU kernel has no dropout, so flash with dropout is the math path there, which a
    development run may mean to compare with local. Returns the note, or None."""
    if run.model.cp_blockwise:  # the blocks' kernel, or one line saying this device has none
        block_kernel(run.model.attention_backend_name, groups.device.type)
        return None
    backend, device = run.model.attention(groups.device), groups.device
    shape = run.model.attention_shape(groups.tp_size, run.training.seq_length, run.precision.torch_dtype)
    refusals = [r for r in groups.world.all_gather_objects(fused_attention_refusal(backend, shape, device)) if r]
    if not refusals:
        return None
    asked = run.model.attention_backend_name
    named = f"--attention-backend {asked}" + (f" ({backend} on {device.type})" if asked != backend else "")
    if device.type == "cuda":
        raise ConfigError(f"{named}: none of torch's fused attention kernels runs this run's attention on "
                          f"{torch.cuda.get_device_name(device)} ({shape.describe()}, per TP rank): {refusals[0]}. "
                          f"Torch would fall back to its math path without saying so: explicit [s, s] scores, "
                          f"slower, in memory the activation line does not count. Use --attention-backend local "
                          f"(Megatron's core attention), or change what torch's reasons name")
    return (f"attention: {named} runs torch's math path on this {device.type} ({refusals[0]}): explicit [s, s] "
            f"scores, which the activation line does not count; --attention-backend local is Megatron's core "
            f"attention")


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts, read from the checkpoint's meta.json before anything is built."""
    iteration: int = 0
    consumed_samples: int = 0
    saved_flags: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # the tokenizer comparison's, if any


def _resume_point(run: RunConfig, groups: ParallelGroups) -> ResumePoint:
    """Read by every rank; a meta.json that only some ranks cannot read fails on all of them (the exchange of
    errors is the agreement), not on one while the others wait in the next collective. The checkpoint's
    tokenizer is compared with this run's here, before anything is built or written (--finetune too: a note)."""
    checkpoint, data = run.checkpoint, run.data

    def read():
        found = read_meta(checkpoint.load) if checkpoint.load else None
        if found is None:
            return None, ()
        directory, meta = found
        note = check_checkpoint_tokenizer(meta, data.tokenizer, directory, checkpoint.finetune,
                                          data.override_tokenizer_check)
        return meta, (note,) if note else ()

    found, error = groups.world.run_agreed(read, (ConfigError,))
    if error:
        raise ConfigError(error)
    meta, notes = found
    if meta is None or checkpoint.finetune:
        return ResumePoint(notes=notes)
    return ResumePoint(meta["iteration"], meta["consumed_samples"], meta.get("config", {}), notes)


def _data_tokenizers(run: RunConfig, groups: ParallelGroups) -> tuple[dict, list[str]]:
    """({--data-path prefix: the tokenizer it was made with, None if unknown}, notes); data made with another
    tokenizer than this run's is refused on every rank (tokenizer_identity.py). Rank 0 reads the records and
    hashes each .idx, and passes what it found to the others."""
    data, world = run.data, groups.world
    prefixes = parse_data_path(list(data.data_path))[0] if data.data_path and not data.mock_data else []
    found, error = world.run_agreed(
        lambda: check_data_tokenizers(prefixes, data.tokenizer, data.override_tokenizer_check) if world.rank == 0
        else None, (ConfigError,))
    if error:
        raise ConfigError(error)
    return world.all_gather_objects(found)[0]


def _resume_notes(run: RunConfig, resumed: ResumePoint) -> list[str]:
    """What a resumed run does differently from the run that saved the checkpoint, said once at start."""
    saved, notes = resumed.saved_flags, list(resumed.notes)
    saved_batch = saved.get("global_batch_size")
    if saved_batch is not None and saved_batch != run.training.global_batch_size:
        notes.append(f"note: the global batch size changed from {saved_batch} (checkpoint) to "
                     f"{run.training.global_batch_size}: continuing at consumed sample {resumed.consumed_samples}")
    if saved:
        saved_dtype = "bf16" if saved.get("bf16") else "fp16" if saved.get("fp16") else "fp32"
        if saved_dtype != run.precision.dtype:
            fresh = "; its fp16 loss scaler starts fresh" if run.precision.dtype == "fp16" else ""
            notes.append(f"note: the checkpoint was trained in {saved_dtype}, this run trains in "
                         f"{run.precision.dtype}{fresh}")
    return notes


def _datasets(run: RunConfig, groups: ParallelGroups, resumed: ResumePoint):
    """(train, valid, test), sized for what the run reads: training from the resume point's consumed samples
    on, at this run's batch size (it may differ from the checkpoint's), and every evaluation reads the first
    --eval-iters global batches of its split. Mock data: three independent synthetic streams."""
    training, data = run.training, run.data
    eval_samples = run.evaluation.eval_iters * training.global_batch_size
    remaining = max(training.train_iters - resumed.iteration, 0) * training.global_batch_size
    sizes = (resumed.consumed_samples + remaining, eval_samples, eval_samples)
    if data.mock_data:
        return tuple(MockGPTDataset(data.vocab_size, training.seq_length, training.seed + k, n) if n else None
                     for k, n in enumerate(sizes))
    return tuple(build_gpt_datasets(list(data.data_path), data.split, training.seq_length, training.seed, sizes,
                                    data.data_cache_path, groups, vocab_size=data.vocab_size))
