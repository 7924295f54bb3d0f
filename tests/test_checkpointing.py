"""Checkpoints: bit-exact resume at the same layout (dropout on), the same next-step loss after reloading
under another TP x DP x ZeRO layout (fp32, 1e-5 relative: the layouts' sums differ in order), a crash
mid-save leaving the previous checkpoint loadable, another model's checkpoint refused, SIGTERM saving,
and the consolidated-weights round trip."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from mpzero.cli.arguments import parse_args, run_config
from mpzero.checkpointing import latest_iteration, save_checkpoint, write_unpublished
from mpzero.parallel import init_parallel
from mpzero.training import build_training_state
from pretrain_gpt import gpt_provider
from tests.cli import ROOT, TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import RanksFailed, run_ranks

TWENTY = TINY + ["--train-iters", "20", "--eval-iters", "0"]


def _layout(tp, dp, stage):
    return tp * dp, ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage)]


def test_resume_at_the_same_layout_is_bit_exact(tmp_path):
    world, layout = _layout(2, 2, 2)
    argv = TWENTY + layout + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save", str(tmp_path)]
    uninterrupted = run_ranks(world, quiet_main, TWENTY + layout + ["--hidden-dropout", "0.1",
                                                                      "--attention-dropout", "0.1"])[0]
    first = run_ranks(world, quiet_main, argv + ["--exit-interval", "10"])[0]
    assert latest_iteration(str(tmp_path)) == 10 and len(first["losses"]) == 10
    resumed = run_ranks(world, quiet_main, argv + ["--load", str(tmp_path)])[0]
    assert first["losses"] + resumed["losses"] == uninterrupted["losses"]
    assert resumed["grad_norms"] == uninterrupted["grad_norms"][10:]


@pytest.mark.parametrize("saved,loaded", [((2, 2, 3), (1, 4, 1)), ((1, 2, 0), (2, 1, 2)), ((2, 1, 1), (1, 1, 3)),
                                          ((1, 4, 2), (2, 2, 0))])
def test_reload_under_another_layout_gives_the_same_next_step_loss(tmp_path, saved, loaded):
    world, layout = _layout(*saved)
    argv = TINY + ["--train-iters", "6", "--eval-iters", "0"]
    uninterrupted = run_ranks(world, quiet_main, argv + layout)[0]
    run_ranks(world, quiet_main, argv + layout + ["--save", str(tmp_path), "--exit-interval", "5"])
    world, layout = _layout(*loaded)
    resumed = run_ranks(world, quiet_main, argv + layout + ["--load", str(tmp_path)])[0]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][5:])


def _training_state(argv):
    """What pretrain_gpt builds before its loop (one shared set-up): groups, model, optimizer, RNG tracker."""
    import torch.distributed as dist
    run = run_config(parse_args(argv), dist.get_world_size())
    groups = init_parallel(run.parallel.tensor_model_parallel_size)
    state = build_training_state(run, gpt_provider, groups)
    return groups, state.model.module, state.optimizer, state.rng


def _crash_after_writing_shards(root, argv):
    """Everything a save of iteration 99 does except its publication, then the process is gone."""
    groups, model, optimizer, rng = _training_state(argv + ["--load", root])  # the same run, saving again
    write_unpublished(root, 99, model, optimizer, rng, groups, {"consumed_samples": 0, "skipped_iterations": 0})


def test_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    argv = TWENTY + ["--zero-stage", "3", "--save", str(tmp_path)]
    run_ranks(2, quiet_main, argv + ["--exit-interval", "10"])
    run_ranks(2, _crash_after_writing_shards, str(tmp_path), argv)
    assert latest_iteration(str(tmp_path)) == 10 and os.path.isdir(tmp_path / "iter_0000099.tmp")
    history, stdout = run_ranks(2, main_capturing_stdout, argv + ["--load", str(tmp_path)])[0]
    assert "loaded checkpoint from" in stdout and "at iteration 10" in stdout and len(history["losses"]) == 10
    assert latest_iteration(str(tmp_path)) == 20


def test_checkpoint_of_another_model_is_refused(tmp_path):
    run_ranks(1, quiet_main, TINY + ["--save", str(tmp_path), "--eval-iters", "0"])
    code, stderr = run_ranks(1, exit_code_and_stderr, TINY + ["--load", str(tmp_path), "--hidden-size", "64"])[0]
    assert code == 2 and stderr.count("\n") == 1
    assert "was saved with --hidden-size 32, this run has 64" in stderr  # the architecture, before the shapes


def _sigterm_then_train(root, argv):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return len(quiet_main(argv)["losses"])


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    argv = TINY + ["--train-iters", "100000", "--eval-iters", "0", "--save", str(tmp_path)]
    stopped_at = run_ranks(2, _sigterm_then_train, str(tmp_path), argv)
    assert stopped_at[0] == stopped_at[1] == latest_iteration(str(tmp_path)) < 100000


def _die_after(delay, report_path, argv):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    code, stderr = exit_code_and_stderr(argv)
    with open(report_path, "w") as f:
        f.write(f"{code}\n{stderr}")


def test_a_dead_rank_makes_the_others_exit_with_an_error(tmp_path):
    argv = TINY + ["--train-iters", "100000", "--eval-iters", "0", "--distributed-timeout-minutes", "0.2"]
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 1 ---\nprocess died"):
        run_ranks(2, _die_after, 1.0, str(tmp_path / "rank0.txt"), argv, deadline=60)
    assert time.monotonic() - start < 40  # the 12 s collective timeout, not the test's deadline
    code, stderr = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert code == "1" and stderr.startswith("error: a collective failed, a peer rank has died or timed out")
    assert stderr.count("\n") == 1


def test_consolidated_weights_round_trip(tmp_path):
    run_ranks(2, quiet_main, TINY + ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "a"),
                                      "--eval-iters", "0"])
    tool = [sys.executable, os.path.join(ROOT, "tools", "checkpoint_util.py")]
    subprocess.run(tool + ["to-consolidated", "--load", str(tmp_path / "a"), "--output", str(tmp_path / "w.pt")],
                   check=True)
    weights = torch.load(tmp_path / "w.pt", weights_only=True)["model"]
    assert weights["embedding.word_embeddings.weight"].shape == (300, 32)  # padding (to 512 at TP=2) removed
    subprocess.run(tool + ["from-consolidated", "--input", str(tmp_path / "w.pt"), "--save", str(tmp_path / "b")],
                   check=True)
    code, _ = run_ranks(1, exit_code_and_stderr, TINY + ["--load", str(tmp_path / "b"), "--eval-iters", "0"])[0]
    assert code == 2  # weights only: the optimizer state is not there
    subprocess.run(tool + ["to-consolidated", "--load", str(tmp_path / "b"), "--output", str(tmp_path / "w2.pt")],
                   check=True)
    again = torch.load(tmp_path / "w2.pt", weights_only=True)["model"]
    assert all(torch.equal(again[name], weights[name]) for name in weights)
    fresh = run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "1"])[0]
    tuned = run_ranks(1, quiet_main, TINY + ["--load", str(tmp_path / "b"), "--finetune", "--eval-iters", "0",
                                             "--train-iters", "1"])[0]
    assert tuned["losses"][0] < fresh["losses"][0] - 0.1  # starts from the trained weights, not from scratch


def test_saving_an_iteration_again_replaces_it_whole(tmp_path):
    from mpzero.files import replace_directory
    (tmp_path / "iter.tmp").mkdir()
    (tmp_path / "iter.tmp" / "new").write_text("")
    (tmp_path / "iter").mkdir()
    (tmp_path / "iter" / "old").write_text("")
    replace_directory(str(tmp_path / "iter.tmp"), str(tmp_path / "iter"))
    assert sorted(os.listdir(tmp_path)) == ["iter"] and os.listdir(tmp_path / "iter") == ["new"]


def test_checkpoint_util_refuses_to_overwrite_a_checkpoint(tmp_path, capsys):
    import runpy
    tool = runpy.run_path(os.path.join(ROOT, "tools", "checkpoint_util.py"))["main"]
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "w.pt")
    os.makedirs(tmp_path / "b" / "iter_0000000.tmp" / "stale")  # left by a crashed conversion
    tool(["from-consolidated", "--input", str(tmp_path / "w.pt"), "--save", str(tmp_path / "b")])
    assert sorted(os.listdir(tmp_path / "b")) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert "stale" not in os.listdir(tmp_path / "b" / "iter_0000000")
    with pytest.raises(SystemExit):
        tool(["from-consolidated", "--input", str(tmp_path / "w.pt"), "--save", str(tmp_path / "b")])
    assert capsys.readouterr().err == (f"error: --save {tmp_path / 'b'} already holds "
                                       f"{tmp_path / 'b' / 'iter_0000000'}: choose an empty directory\n")


def _save_and_count_dp_bytes(root, argv):
    groups, model, optimizer, rng = _training_state(argv)
    before = groups.dp.stats.total()
    save_checkpoint(root, 1, model, optimizer, rng, groups, {"consumed_samples": 0, "skipped_iterations": 0})
    return groups.dp.stats.total() - before


def test_each_rank_writes_its_own_partition_without_gathering(tmp_path):
    """ZeRO-3 at DP=4: no data-parallel traffic during the save, and every rank writes about a quarter."""
    argv = TINY + ["--zero-stage", "3"]
    assert run_ranks(4, _save_and_count_dp_bytes, str(tmp_path), argv) == [0, 0, 0, 0]
    sizes = [os.path.getsize(tmp_path / "iter_0000001" / f"__{r}_0.distcp") for r in range(4)]
    assert min(sizes) > 0.7 * max(sizes), sizes  # equal partitions; per-chunk headers vary a little


def test_resume_with_another_lr_schedule_says_so(tmp_path):
    argv = TINY + ["--eval-iters", "0", "--save", str(tmp_path)]
    run_ranks(1, quiet_main, argv + ["--exit-interval", "5"])
    _, same = run_ranks(1, main_capturing_stdout, argv + ["--load", str(tmp_path)])[0]
    _, other = run_ranks(1, main_capturing_stdout, argv + ["--load", str(tmp_path), "--lr", "2e-3"])[0]
    assert "schedule differs" not in same
    assert "note: the learning-rate schedule differs from the checkpoint's" in other
