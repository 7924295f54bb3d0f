"""A bf16 or fp32 training iteration does not read the device at all between log lines (issue 46): its step is
launched with the gradient norm, the clipping coefficient and the non-finite check on the device, and the loss,
norm and SIGTERM flag are read at the next log line (mpzero/training/deferred.py), with the same results bit for bit
as the synchronising step's. An fp16 iteration with torch's fused AdamW (the CPU default: fp16 launches with the
Triton kernel and the reference arithmetic, tests/test_fp16_launched.py), and any with --sync-every-iteration, reads
it at most once (issue 26): the step's finite check and gradient norm, with fp16's overflow check, the loss-scale update, the NaN checks,
the loss and the SIGTERM flag riding along in the same read. Logging iterations read more and are not counted; nor
is the first iteration (its one-off memory and activation reports).

A host synchronisation is counted where the host must wait for a device value:
- Python-level reads, seen by a `TorchFunctionMode`: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`,
  `bool()`, `float()`, `int()`, `operator.index()` of a tensor;
- ops that read values or whose output shape depends on them, seen by a `TorchDispatchMode` (also when
  called from C++ or from inside torch): `aten._local_scalar_dense` (what every scalar read ends in),
  `nonzero`, `masked_select`, `unique`, `repeat_interleave` without an output size, `is_nonzero`, `equal`,
  and indexing by a boolean mask (`x[mask]`, `x[mask] = v`: a nonzero() inside the op).
On CPU some cannot be seen: a device-to-host copy by `.to("cpu")`, `copy_` into a host tensor or a
`non_blocking=False` transfer is a host-to-host no-op here (nothing is dispatched, or the source is already
on the host), and a CUDA stream or event synchronise has no CPU counterpart. Those are left to review and to
`make gpu-check`; everything the loop and the optimizer read through the calls above fails here.
"""

import pytest
import torch

from tests.cli import TINY, quiet_main
from tests.distributed import run_ranks
from tests.host_syncs import counting


def _syncs_per_iteration(argv) -> tuple[dict[int, list], dict]:
    """Train with `argv`, counting; ({iteration: its syncs}, the run's history), an iteration running from the start
    of its forward-backward to the start of the next one's (so its step, checks and logging are all in it)."""
    import mpzero.training.loop as loop
    starts = []
    forward_backward = loop.forward_backward

    def marked(*args, **kwargs):
        starts.append(len(syncs.events))
        return forward_backward(*args, **kwargs)

    loop.forward_backward = marked  # this forked rank's own copy of the module
    with counting() as syncs:
        history = quiet_main(argv)
    bounds = starts + [len(syncs.events)]
    return {i + 1: syncs.events[bounds[i]:bounds[i + 1]] for i in range(len(starts))}, history


PRECISIONS = {"fp32": [], "bf16": ["--bf16"],
              "fp16": ["--fp16", "--initial-loss-scale", "1048576"]}  # overflows, skips and backs off at first
RUN = TINY + ["--train-iters", "7", "--log-interval", "3", "--eval-iters", "0"]
COUNTED = (2, 4, 5)  # not the first, not a logging iteration (3, 6), not the last (it runs to the exit)


def _assert_at_most_one_sync(per_rank: list[dict], most: int = 1) -> None:
    for rank, (per_iteration, _) in enumerate(per_rank):
        for iteration in COUNTED:
            events = per_iteration[iteration]
            assert len(events) <= most, (f"rank {rank}, iteration {iteration}: {len(events)} host syncs\n  "
                                         + "\n  ".join(f"{what} at {where}" for what, where in events))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_launched_iteration_does_not_sync_and_trains_as_the_synchronising_one_at_dp2(stage, precision):
    argv = RUN + ["--zero-stage", str(stage), "--clip-grad", "0.05"] + PRECISIONS[precision]
    launched = run_ranks(2, _syncs_per_iteration, argv)
    _assert_at_most_one_sync(launched, most=0)
    synchronising = run_ranks(2, _syncs_per_iteration, argv + ["--sync-every-iteration"])
    _assert_at_most_one_sync(synchronising)
    for (_, got), (_, want) in zip(launched, synchronising):
        assert got["losses"] == want["losses"] and got["grad_norms"] == want["grad_norms"]  # bit for bit


def test_fp16_syncs_at_most_once_at_dp2():
    argv = RUN + ["--zero-stage", "2"] + PRECISIONS["fp16"]
    _assert_at_most_one_sync(run_ranks(2, _syncs_per_iteration, argv))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_iteration_syncs_with_the_host_at_most_once_in_one_process(precision):
    argv = RUN + ["--zero-stage", "3"] + PRECISIONS[precision]
    _assert_at_most_one_sync(run_ranks(1, _syncs_per_iteration, argv), most=1 if precision == "fp16" else 0)


def test_an_iteration_syncs_with_the_host_at_most_once_at_tp2():
    argv = RUN + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1",
                  "--fp16", "--initial-loss-scale", "1048576"]
    _assert_at_most_one_sync(run_ranks(2, _syncs_per_iteration, argv))
    bf16 = RUN + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1", "--bf16"]
    _assert_at_most_one_sync(run_ranks(2, _syncs_per_iteration, bf16), most=0)


def test_the_counter_sees_scalar_reads_and_data_dependent_shapes():
    x = torch.tensor([1.0, 0.0, 2.0])
    with counting() as syncs:
        x.sum().item(), x.tolist(), bool(x[0]), float(x[1]), x.nonzero(), x[x > 0], x.cpu()
        x[x > 1] = 0
        x.mul(2).add_(1)  # no read
    assert [what for what, _ in syncs.events] == [
        "item", "tolist", "__bool__", "__float__", "aten.nonzero.default", "aten.index.Tensor", "cpu",
        "aten.index_put_.default"]
