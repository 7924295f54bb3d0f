"""Stage 3 with units smaller than a layer (`--zero-units linear`, ZeRO-Infinity's memory-centric tiling at the
granularity of a linear layer) and the gather schedule's replay (`mpzero.zero.schedule3`):

- the trace `Stage3` records equals the one the planner predicts from the model's layers and recomputation flags,
  for layer and linear units, with and without full recomputation (chunks of 1 and 2 layers, block);
- the in-step peak the meter counts equals the shards' formula plus the replay of that trace, byte for byte, for
  GPT-2 and LLaMA layers, fp32 and bf16, with and without prefetch;
- linear units hold less than layer units at the peak (the point of them), most of all under full recomputation;
- through the command line: TP 2 x DP 2 with linear units, sequence parallelism and full recomputation trains like
  one process (fp32, 1e-5), and its `zero comm` line counts the third gather of every recomputed unit at theory;
- the flag's misuses are one line each."""

import dataclasses

import pytest
import torch

from mpzero.models import GPTConfig, family_of
from mpzero.parallel import init_parallel
from mpzero.planner import full_recompute_chunks, model_shapes, normalized
from mpzero.tensor_parallel import seed_everything
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer, stage3_working_set
from tests.cli import TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks

GPT2 = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=200, max_position_embeddings=16,
                 hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dataclasses.replace(GPT2, normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
                            position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
                            add_bias_linear=False, untie_embeddings_and_output_weights=True)
RECOMPUTE = {"none": {}, "full": dict(recompute_granularity="full"),
             "chunks": dict(recompute_granularity="full", recompute_num_layers=2),
             "block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)}
BYTES = {"fp32": (4, 4), "bf16": (2, 4)}


def _step(config, units, dtype, prefetch):
    groups = init_parallel(1)
    precision = PrecisionConfig(dtype)
    model = family_of(config).build(config, groups.tp, seed_everything(1, 0, groups.device)).to(precision.torch_dtype)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3, units=units, prefetch=prefetch), AdamConfig(), precision)
    for step in range(2):
        tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        opt.backward(loss, last_micro_batch=True)
        opt.step()
    stage = opt.stage
    return dict(trace=list(stage.trace), peak=opt.memory_report().peak, measured=opt.memory_report().measured,
                layouts=stage.layouts, comm=stage.regathered_numel())


def _config(family, recompute):
    return dataclasses.replace({"gpt2": GPT2, "llama": LLAMA}[family], **RECOMPUTE[recompute])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("units", ["layer", "linear"])
def test_the_recorded_trace_is_the_predicted_one_and_the_peak_its_replay(family, recompute, units):
    config = _config(family, recompute)
    dtype = "bf16" if recompute == "full" else "fp32"
    p, g = BYTES[dtype]
    shapes = model_shapes(normalized(config), 1)  # as the planner reads it: the recomputation passed apart
    predicted = list(shapes.stage3_trace(units, full_recompute_chunks(config)))
    for result in run_ranks(2, _step, config, units, dtype, True):
        assert result["trace"] == predicted
        replay = stage3_working_set(result["layouts"], predicted, p, g, gathers=True, staged=False, prefetch=True,
                                    overlap=True, streamed=False, release_recomputed=units == "linear")
        assert result["peak"].measured == result["measured"] + replay.peak, (result["peak"], replay)
        assert result["peak"].formula_text.endswith(replay.text)
        # a third gather for each recomputed unit smaller than a layer, none otherwise
        assert (result["comm"] > 0) == (units == "linear" and recompute != "none")


@pytest.mark.parametrize("prefetch", [True, False])
def test_without_prefetch_the_peak_is_still_the_replay(prefetch):
    config = _config("gpt2", "full")
    for result in run_ranks(2, _step, config, "linear", "fp32", prefetch):
        replay = stage3_working_set(result["layouts"], result["trace"], 4, 4, gathers=True, staged=False,
                                    prefetch=prefetch, overlap=True, streamed=False, release_recomputed=True)
        assert result["peak"].measured == result["measured"] + replay.peak


def test_linear_units_hold_less_than_layer_units():
    """Planner figures (each equal to the counted peak by the tests above) for a wider model: the working set of
    linear units is a fraction of the layer units', with full recomputation too."""
    config = dataclasses.replace(GPT2, num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=64)
    for recompute in ("none", "full"):
        model = dataclasses.replace(config, **RECOMPUTE[recompute])
        shapes = model_shapes(normalized(model), 1)
        peaks = {}
        for units in ("layer", "linear"):
            layouts = shapes.layouts(3, 4, 0, 1, units)
            trace = list(shapes.stage3_trace(units, full_recompute_chunks(model)))
            peaks[units] = stage3_working_set(layouts, trace, 2, 2, gathers=True,
                                              staged=False, prefetch=True, overlap=True, streamed=False,
                                              release_recomputed=units == "linear").peak
        assert peaks["linear"] < 0.6 * peaks["layer"], (recompute, peaks)


ARGV = TINY + ["--num-layers", "3", "--micro-batch-size", "1"]  # evaluating every 5: its gathers are not training's


def test_linear_units_train_like_one_process_and_count_the_third_gather():
    reference = run_ranks(1, main_capturing_stdout, ARGV + ["--zero-stage", "0"])[0][0]
    argv = ARGV + ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--zero-units", "linear",
                   "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "1"]
    history, stdout = run_ranks(4, main_capturing_stdout, argv)[0]
    assert_close_lists(history["losses"], reference["losses"])
    assert_close_lists(history["grad_norms"], reference["grad_norms"])
    comm = [dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])
            for line in stdout.splitlines() if line.startswith("zero comm")]
    assert comm and all("X" in line["theory"] for line in comm), comm
    for line in comm:
        assert float(line["ratio"]) == pytest.approx(1.0, abs=0.01), line


@pytest.mark.parametrize("extra,message", [
    (["--zero-stage", "2"], "--zero-units linear chooses what stage 3 gathers at once, but --zero-stage is 2"),
    (["--zero-stage", "3", "--torch-compile"], "--torch-compile compiles whole"),
])
def test_misuse_is_one_line(extra, message):
    code, stderr = exit_code_and_stderr(TINY + ["--zero-units", "linear"] + extra)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and message in lines[0], stderr


def test_a_checkpoint_of_layer_units_resumes_with_linear_units(tmp_path):
    """Units are a layout choice: a stage-3 checkpoint saved with layer units loads with linear units (and
    recomputation) and the next steps' losses are the uninterrupted run's."""
    argv = TINY + ["--train-iters", "6", "--eval-iters", "0", "--zero-stage", "3"]
    uninterrupted = run_ranks(2, main_capturing_stdout, argv)[0][0]
    run_ranks(2, main_capturing_stdout, argv + ["--save", str(tmp_path), "--exit-interval", "4"])
    resumed = run_ranks(2, main_capturing_stdout, argv + ["--load", str(tmp_path), "--zero-units", "linear",
                                                          "--recompute-granularity", "full"])[0][0]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][4:])


def test_the_dry_run_of_linear_units_equals_the_plan():
    """pretrain_gpt.py --dry-run (the real code on meta tensors) and the planner agree on every figure with linear
    units under full recomputation: the peak replayed from the predicted trace, the third gathers in DP bytes."""
    argv = TINY + ["--num-layers", "4", "--tensor-model-parallel-size", "2", "--zero-stage", "3", "--zero-units",
                   "linear", "--recompute-granularity", "full", "--recompute-num-layers", "2", "--dry-run",
                   "--world-size", "8", "--rank", "3"]
    _, stdout = main_capturing_stdout(argv)
    (line,) = [line for line in stdout.splitlines() if line.startswith("planner |")]
    assert line.endswith("| equal"), line


@pytest.mark.parametrize("micro_batch", ["1", "2"])
def test_offloaded_linear_units_print_their_peak_at_its_formula(micro_batch):
    """Parameters and optimizer offloaded (device staging of the shards, gradients streamed to the host), linear
    units, full recomputation, DP 2: every memory line after a step has counted = formula for the peak, the first
    one too (one micro-batch per step: the first ran without prefetch, the formula says so)."""
    argv = TINY + ["--bf16", "--zero-stage", "3", "--zero-units", "linear", "--offload-optimizer", "cpu",
                   "--offload-params", "cpu", "--recompute-granularity", "full", "--micro-batch-size", micro_batch,
                   "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "0"]
    _, stdout = run_ranks(2, main_capturing_stdout, argv)[0]
    lines = [dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])
             for line in stdout.splitlines() if line.startswith("zero memory")]
    lines = [memory for memory in lines if "peak bytes" in memory]  # after a step
    assert lines, stdout
    for memory in lines:
        assert int(memory["peak bytes"]) - int(memory["measured bytes"]) == \
            int(memory["peak formula bytes"]) - int(memory["formula bytes"]), memory
