"""The planner with pipeline parallelism (mpzero/planner/pipeline.py and the pipeline half of plan.py): layouts over
TP x PP x DP x ZeRO stage x schedule only where a run takes them (Megatron's layer split and micro-batch rules, no
ZeRO-3 with a pipeline), every pipeline rank evaluated on its own stage with the largest deciding, the schedules'
bubbles, and PTD-P's Table 1 layouts fitting their A100-80GB (the dry run's `equal` for a 3-D rank is in
test_dry_run.py; every row's in bench/bench_pipeline_planner.py)."""

import pytest

from mpzero.cli.arguments import parse_args, planner_sections
from mpzero.pipeline import Pipeline, Times, bubble, build, simulate
from mpzero.planner import bubble_fraction
from mpzero.planner.cost import Hardware
from mpzero.planner.plan import Layout, Machine, Planner

GIB = 2 ** 30
SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--vocab-size", "1000", "--global-batch-size", "16", "--mock-data", "--micro-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-4"]


def _planner(argv, world, memory=GIB, cuda=False):
    return Planner(planner_sections(parse_args(argv), 1000), Machine(world, memory, cuda=cuda))


@pytest.mark.parametrize("p,v,m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (8, 2, 16), (4, 1, 4)])
def test_bubbles_are_the_schedules_idle_time(p, v, m):
    """(p - 1)/m and (p - 1)/(v m) are the simulated idle time over the compute time; ZB-H1's own is a third of
    1F1B's when its passes take alike (s << h in the FLOPs of Qi et al.)."""
    for kind in (["interleaved"] if v > 1 else ["1f1b", "zb-h1"]):
        pipe = Pipeline(p, v, m)
        times = Times(F=1.0, B=2.0, I=1.0, W=1.0)
        work = m * v * (times.F + (times.I + times.W if kind == "zb-h1" else times.B))
        simulated = simulate(pipe, build(kind, pipe), times)
        assert max(simulated.idle) == pytest.approx(bubble(kind, pipe, times))
        assert bubble_fraction(kind, p, v, m, hidden=10 ** 6, seq=0) == pytest.approx(max(simulated.idle) / work)


def test_layouts_keep_to_what_a_run_takes():
    layouts = _planner(SMALL, 8).layouts(tiers=["none"], recompute=["none"], micro_batches=[1, 2])
    assert {lay.pp for lay in layouts} == {1, 2, 4}  # 4 layers: no 8 stages
    for lay in layouts:
        assert lay.tp * lay.pp * lay.dp == 8
        if lay.pp > 1:
            assert lay.stage < 3 and (lay.schedule == "1f1b" or lay.stage < 2)
            assert lay.schedule != "interleaved" or lay.micro_batches % lay.pp == 0
            assert lay.schedule != "zb-h1" or lay.micro_batches >= lay.pp
    assert {lay.schedule for lay in layouts if lay.pp == 2} == {"1f1b", "interleaved", "zb-h1"}


def test_the_largest_stage_decides_and_the_slowest_sets_the_time():
    """1F1B at PP 4 on an uneven split [1, 1, 1, 5]: the plan shown is the pipeline rank with the largest device
    peak, and the time is the last stage's (5 layers against the even 2); evenly split, stage 0 holds 4 micro-batches
    and decides."""
    planner = _planner(SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                                "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "5"],
                       4)
    plan = planner.evaluate(Layout(1, 1, 1, 1, 16, pp=4))
    assert plan.device_peak == max(plan.stage_peaks) == plan.stage_peaks[plan.pp_rank]
    even = _planner(SMALL + ["--num-layers", "8"], 4).evaluate(Layout(1, 1, 1, 1, 16, pp=4))
    assert plan.cost.compute == pytest.approx(even.cost.compute * 5 / 2)  # 5 layers against 8/4
    assert even.activations.held == 4 * even.activations.saved and even.pp_rank == 0


@pytest.mark.parametrize("row", [
    (24, 2304, 24, 1, 1, 32, 512), (48, 6144, 40, 8, 1, 256, 1024), (64, 8192, 48, 8, 2, 512, 1536),
    (96, 12288, 80, 8, 8, 1536, 2304), (128, 16384, 96, 8, 16, 1920, 2160), (128, 20480, 105, 8, 35, 2520, 2520),
    (160, 25600, 128, 8, 64, 3072, 3072)], ids=["1.7B", "18.4B", "39.1B", "145.6B", "310.1B", "529.6B", "1T"])
def test_ptdp_table_1_fits_its_a100s(row):
    """PTD-P's layouts (their TP x PP, GPUs, batch; micro-batch 1, every layer recomputed, the interleaved
    schedule, no sharded optimizer: ZeRO-0) fit 80 GiB with 2 GiB kept free, on every pipeline rank."""
    heads, hidden, layers, tp, pp, gpus, batch = row
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--vocab-size", "51200", "--micro-batch-size", "1", "--global-batch-size",
            str(batch), "--bf16", "--train-iters", "1", "--lr", "1e-4", "--mock-data"]
    machine = Machine(gpus, 80 * GIB, None, None, 2 * GIB, True, Hardware())
    v = 1 if pp == 1 else 2 if (layers // pp) % 2 == 0 else layers // pp
    plan = Planner(planner_sections(parse_args(argv), 51200), machine).evaluate(
        Layout(tp, gpus // (tp * pp), 0, 1, batch, recompute="full", pp=pp, virtual_stages=v))
    assert plan.fits and len(plan.stage_peaks) == pp and max(plan.stage_peaks) + 2 * GIB <= 80 * GIB
