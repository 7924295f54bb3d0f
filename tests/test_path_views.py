"""mpzero/path_views.py: every rank's view of --load, --save and --offload-path compared at start (issue 42, item 2).

Each compared flag (path_views.COMPARED_FLAGS: a flag added there is tested here) is given every pair of views two
ranks can have (missing, a file, an empty directory, checkpoints up to two different iterations, a damaged
pointer): where the views differ, one ConfigError line on both ranks naming the flag and each rank's view, and
nothing where they agree. Through pretrain_gpt.py, two ranks each in its own working directory (a relative path,
as two machines would resolve it): --load present for one rank only, --save holding checkpoints for one only,
each one line on every rank within seconds, not the distributed timeout. tests/test_multinode.py runs the same
--load case as two torchrun nodes."""

import itertools
import os
import time

import torch.distributed as dist

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.path_views import COMPARED_FLAGS, check_same_views, path_view
from tests.cli import TINY, exit_code_and_stderr, quiet_main
from tests.distributed import run_ranks

RUN = TINY + ["--eval-iters", "0", "--train-iters", "2"]
KINDS = ("missing", "file", "empty directory", "iteration 2", "iteration 3", "damaged pointer")


def _make(path, kind):
    if kind == "file":
        open(path, "w").close()
    elif kind != "missing":
        os.makedirs(path)
        pointer = {"iteration 2": "2", "iteration 3": "3", "damaged pointer": "two"}.get(kind)
        if pointer:
            with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(pointer)


def _compare_on_each_rank(cases):
    """Each rank checks `thing` from its own directory of every case (one relative path, two machines): the
    errors (or None), case by case."""
    rank, errors = dist.get_rank(), []
    world = CommGroup(dist.group.WORLD, (0, 1), rank)
    for base, dest in cases:
        os.chdir(os.path.join(base, f"rank{rank}"))
        try:
            check_same_views(world, {dest: "thing"})
            errors.append(None)
        except ConfigError as error:
            errors.append(str(error))
    return errors


def test_every_compared_flag_refuses_every_disagreement_in_one_line(tmp_path):
    cases = []
    for (flag, dest), (a, b) in itertools.product(COMPARED_FLAGS.items(), itertools.product(KINDS, repeat=2)):
        base = tmp_path / f"{dest}-{KINDS.index(a)}-{KINDS.index(b)}"
        for rank, kind in enumerate((a, b)):
            (base / f"rank{rank}").mkdir(parents=True)
            _make(str(base / f"rank{rank}" / "thing"), kind)
        cases.append((str(base), dest))
    per_rank = run_ranks(2, _compare_on_each_rank, cases)
    for (base, dest), errors in zip(cases, zip(*per_rank)):
        flag = next(f for f, d in COMPARED_FLAGS.items() if d == dest)
        views = [path_view(flag, os.path.join(base, f"rank{r}", "thing")) for r in (0, 1)]
        if views[0] == views[1]:
            assert errors == (None, None), (base, errors)
        else:
            assert errors[0] == errors[1] and "\n" not in errors[0], errors
            assert errors[0].startswith(f"{flag} thing is not the same") and f"rank 0 sees {views[0]}" in errors[0] \
                and f"rank 1 sees {views[1]}" in errors[0], errors[0]
    print(f"path views: {len(COMPARED_FLAGS)} flags x {len(KINDS) ** 2} pairs of views = {len(cases)} cases")


def _in_own_directory(base, argv):
    os.chdir(os.path.join(base, f"rank{dist.get_rank()}"))
    start = time.monotonic()
    code, stderr = exit_code_and_stderr(argv)
    return code, stderr, time.monotonic() - start


def test_a_path_one_rank_sees_and_another_does_not_is_one_line_on_every_rank_within_seconds(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    run_ranks(1, quiet_main, RUN + ["--save", str(tmp_path / "rank0" / "ckpt")])  # rank 0's machine only
    cases = {"--load": RUN + ["--load", "ckpt"],
             "--save": RUN + ["--save", "ckpt", "--overwrite-checkpoints", "--save-interval", "100"]}
    for flag, argv in cases.items():
        for code, stderr, seconds in run_ranks(2, _in_own_directory, str(tmp_path), argv):
            assert code == 2 and stderr.count("\n") == 1, stderr
            assert stderr.startswith(f"error: {flag} ckpt is not the same for every rank: rank 0 sees checkpoints "
                                     f"up to iteration 2; rank 1 sees "), stderr
            assert seconds < 30, f"{flag}: {seconds:.0f} s"
