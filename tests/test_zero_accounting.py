"""Counted model-state memory and communication against the ZeRO formulas, and the printed lines."""


import pytest

from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model

MICRO = 2


def _accounting(stage, dtype, iterations=2):
    groups = init_parallel(tp_size=1)
    precision = PrecisionConfig(dtype, initial_loss_scale=1024)
    model = make_model().to(precision.torch_dtype)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(), precision)
    memory = opt.memory_report()
    per_backward = []
    for step_batches in make_batches(iterations, MICRO, groups.dp_size):
        for m, micro_batch in enumerate(step_batches):
            before = groups.dp.stats.total()
            opt.backward(model(*micro_batch[groups.dp_rank]).mean() / MICRO, last_micro_batch=(m == MICRO - 1))
            per_backward.append(groups.dp.stats.total() - before)
        opt.step()
    return memory, opt.comm_report(), per_backward


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_zero_model_state_bytes_match_formula(dtype):
    for stage in (0, 1, 2, 3):
        for memory, _, _ in run_ranks(4, _accounting, stage, dtype, iterations=1):
            # Off only by padding (< 4 elements per flat buffer; moments skip it, so a rank whose
            # slices hold the padding keeps a little less) and Adam's 4-byte step counters.
            assert memory.ratio == pytest.approx(1.0, abs=0.02), memory.line()


def test_zero_memory_formula_is_the_zero_paper_for_fp16():
    texts = {stage: run_ranks(2, _accounting, stage, "fp16", iterations=1)[0][0].formula_text for stage in range(4)}
    assert texts == {0: "16P", 1: "4P+12P/N", 2: "2P+14P/N", 3: "16P/N"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_counted_communication_matches_theory(stage):
    for _, comm, per_backward in run_ranks(4, _accounting, stage, "bf16"):
        assert comm.ratio == pytest.approx(1.0, abs=0.01), comm.line()
        if stage < 2:  # accumulation communicates once per global batch: nothing before the last micro-batch
            assert per_backward[0] == per_backward[2] == 0 and per_backward[1] > 0
        else:  # stages 2-3 hold no full gradients, so every micro-batch is reduced
            assert all(b > 0 for b in per_backward)


def test_zero_report_lines_are_parseable():
    memory, comm, _ = run_ranks(2, _accounting, 2, "fp16")[0]
    fields = dict(part.strip().rsplit(" ", 1) for part in memory.line().split("|")[1:])
    assert fields == {"stage": "2", "dp": "2", "params": str(memory.numel), "measured bytes": str(memory.measured),
                      "formula": "2P+14P/N", "formula bytes": f"{memory.formula:.0f}",
                      "ratio": f"{memory.ratio:.4f}", "padding elements": str(memory.padding)}
    fields = dict(part.strip().rsplit(" ", 1) for part in comm.line().split("|")[1:])
    assert fields["theory"] == "(6P)(N-1)/N" and fields["micro-batches"] == "2"
    assert float(fields["measured bytes/iter"]) == pytest.approx(comm.measured, abs=1)
    assert float(fields["ratio"]) == pytest.approx(comm.ratio, abs=1e-4)
