"""Counted model-state memory and communication against the ZeRO formulas, and the printed lines."""


import pytest

from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model

MICRO = 2

# Bytes per parameter, written out: (parameter p, gradient g, optimizer state K). The ZeRO paper's mixed
# precision Adam (fp16) is 2 + 2 + 12 = 16 (fp32 master 4 + momentum 4 + variance 4). bf16 keeps its
# gradients in fp32, as Megatron accumulates bf16 gradients in fp32: 2 + 4 + 12 = 18. Pure fp32 trains the
# parameters themselves (no separate master copy): 4 + 4 + 8 = 16.
# bf16-grads (--grad-reduce-in-bf16) keeps them in bf16: the fp16 figures, 2 + 2 + 12.
BYTES = {"fp16": (2, 2, 12), "bf16": (2, 4, 12), "bf16-grads": (2, 2, 12), "fp32": (4, 4, 8)}


def _counted_params():
    """(P, R): trainable parameters of the toy model and of its root unit (everything outside the layers:
    the tied word embedding and the final LayerNorm; the position embedding is frozen), counted here."""
    model = make_model()
    trainable = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    return sum(n for _, n in trainable), sum(n for name, n in trainable if not name.startswith("layers."))


def _expected_memory(stage, dtype, n):
    """The ZeRO paper's per-rank model-state bytes: stage 1 partitions K, stage 2 also g, stage 3 also p."""
    p, g, k = BYTES[dtype]
    total, _ = _counted_params()
    replicated, partitioned = {0: (p + g + k, 0), 1: (p + g, k), 2: (p, g + k), 3: (0, p + g + k)}[stage]
    return total * (replicated + partitioned / n)


def _expected_comm(stage, dtype, n, m):
    """Per-rank bytes per iteration in the ring model, (N-1)/N of each collective's full size: stage 0
    all-reduces the gradients (2 g P); stage 1 reduce-scatters them once and all-gathers the parameters
    ((g + p) P); stage 2 reduce-scatters on each of the m micro-batches ((m g + p) P); stage 3 gathers every
    unit, the root included, for forward and again for backward and reduce-scatters every micro-batch
    (m (2 p P + g P)). With g = p: the paper's 2P, 3P."""
    p, g, _ = BYTES[dtype]
    total, _ = _counted_params()
    per_iteration = {0: 2 * g * total, 1: (g + p) * total, 2: (m * g + p) * total, 3: m * (2 * p + g) * total}[stage]
    return per_iteration * (n - 1) / n


def _accounting(stage, dtype, iterations=2):
    groups = init_parallel(tp_size=1)
    precision = PrecisionConfig(dtype.removesuffix("-grads"), initial_loss_scale=1024,
                                accumulate_allreduce_grads_in_fp32=False if dtype == "bf16-grads" else None)
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


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "bf16-grads"])
def test_zero_model_state_bytes_match_formula(dtype):
    total, _ = _counted_params()
    assert total == 370 + 2 * (20 + 253 + 240) + 20  # embedding 37x10, 2 blocks (LN, fc1, fc2), final LN
    for stage in (0, 1, 2, 3):
        expected = _expected_memory(stage, dtype, 4)
        for memory, _, _ in run_ranks(4, _accounting, stage, dtype, iterations=1):
            assert memory.numel == total, memory.line()
            assert memory.formula == pytest.approx(expected, rel=1e-12), memory.line()
            # Off only by padding (< 4 elements per flat buffer; moments skip it, so a rank whose
            # slices hold the padding keeps a little less) and Adam's 4-byte step counters.
            assert memory.measured == pytest.approx(expected, rel=0.02), memory.line()


def test_zero_memory_formula_is_the_zero_paper_for_fp16():
    texts = {stage: run_ranks(2, _accounting, stage, "fp16", iterations=1)[0][0].formula_text for stage in range(4)}
    assert texts == {0: "16P", 1: "4P+12P/N", 2: "2P+14P/N", 3: "16P/N"}


@pytest.mark.parametrize("dtype", ["bf16", "bf16-grads"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_counted_communication_matches_theory(stage, dtype):
    expected = _expected_comm(stage, dtype, 4, MICRO)
    for _, comm, per_backward in run_ranks(4, _accounting, stage, dtype):
        assert comm.theory == pytest.approx(expected, rel=1e-12), comm.line()
        assert comm.measured == pytest.approx(expected, rel=0.01), comm.line()
        if stage < 2:  # accumulation communicates once per global batch: nothing before the last micro-batch
            assert per_backward[0] == per_backward[2] == 0 and per_backward[1] > 0
        else:  # stages 2-3 hold no full gradients, so every micro-batch is reduced
            assert all(b > 0 for b in per_backward)


def test_zero_report_lines_are_parseable():
    memory, comm, _ = run_ranks(2, _accounting, 2, "fp16")[0]
    total, _ = _counted_params()
    fields = dict(part.strip().rsplit(" ", 1) for part in memory.line().split("|")[1:])
    # formula bytes: the paper's 2P + 14P/N at P counted here, N = 2
    construction = {f"{t.name.replace(' ', '-')} {key}": value for t in memory.construction
                    for key, value in (("bytes", str(t.measured)), ("formula", t.formula_text),
                                       ("formula bytes", f"{t.formula:.0f}"), ("ratio", f"{t.ratio:.4f}"))}
    assert fields == {"stage": "2", "dp": "2", "params": str(total), "measured bytes": str(memory.measured),
                      "formula": "2P+14P/N", "formula bytes": f"{2 * total + 14 * total / 2:.0f}",
                      "ratio": f"{memory.ratio:.4f}", "padding elements": str(memory.padding), **construction}
    assert construction["construction-peak formula"].startswith("2P+14P/N+")
    fields = dict(part.strip().rsplit(" ", 1) for part in comm.line().split("|")[1:])
    assert fields["theory"] == "(6P)(N-1)/N" and fields["micro-batches"] == "2"
    assert float(fields["measured bytes/iter"]) == pytest.approx(comm.measured, abs=1)
    assert float(fields["ratio"]) == pytest.approx(comm.ratio, abs=1e-4)
