"""Configuration checked at start, once, one line each: --config values through the flags' own types, choices
and exclusions; every numeric flag within its range; output paths writable; and an fp16 run stuck at its
minimum loss scale stops instead of saving an untrained model."""

import json

import pytest

from mpzero.cli.arguments import parse_args
from mpzero.errors import ConfigError
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks

RUN = TINY + ["--eval-iters", "0"]


def _config(tmp_path, text: str, suffix=".yaml") -> str:
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,message", [
    ('bf16: "false"\n', "bf16 is 'false': write true or false (unquoted)"),
    ("fp16: true\nbf16: true\n", "sets bf16 and fp16: they exclude each other, keep one"),
    ("num-layers: 2.7\n", "num-layers is 2.7, not an integer"),
    ("zero-stage: 5\n", "zero-stage is 5: choose one of 0, 1, 2, 3"),
    ("lr: fast\n", "lr is 'fast', not a number"),
    ("hiden-size: 3\n", "unknown flag 'hiden-size': did you mean 'hidden-size'?"),
])
def test_config_file_values_go_through_the_flags_types(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        parse_args(RUN + ["--config", _config(tmp_path, text)])
    assert message in str(error.value)


def test_config_file_mock_data_string_is_refused_not_true(tmp_path):
    path = _config(tmp_path, json.dumps({"mock-data": "no"}), ".json")
    with pytest.raises(ConfigError, match="mock-data is 'no': write true or false"):
        parse_args([a for a in RUN if a != "--mock-data"] + ["--config", path])


def test_config_file_switches_and_the_command_line_winning_across_an_exclusive_pair(tmp_path):
    args = parse_args(RUN + ["--config", _config(tmp_path, "bf16: true\nno-overlap-comm: true\nsplit: 1,1,1\n")])
    assert args.bf16 and not args.fp16 and args.overlap_comm is False and args.split == "1,1,1"
    args = parse_args(RUN + ["--config", _config(tmp_path, "bf16: true\noverlap_comm: true\n"), "--fp16"])
    assert args.fp16 and not args.bf16 and args.overlap_comm is True


@pytest.mark.parametrize("flags,message", [
    (["--lr-decay-iters", "-5"], "--lr-decay-iters -5 is out of range: it must be >= 1"),
    (["--lr", "nan"], "--lr nan must be a finite number"),
    (["--lr-warmup-iters", "50"], "--lr-warmup-iters 50 is longer than the run (--train-iters 10)"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout 1.5 is out of range: it must be >= 0.0 and < 1.0"),
    (["--seed", "-1"], "--seed -1 is out of range"),
    (["--adam-beta2", "1.0"], "--adam-beta2 1.0 is out of range"),
    (["--eval-iters", "-1"], "--eval-iters -1 is out of range: it must be >= 0"),
    (["--clip-grad", "inf"], "--clip-grad inf must be a finite number"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale 0.0 is out of range: it must be > 0.0"),
    (["--zero-stage", "7"], "argument --zero-stage: invalid choice: 7"),
])
def test_numbers_out_of_range_are_one_line_before_any_work(flags, message):
    code, stderr = run_ranks(1, exit_code_and_stderr, RUN + flags)[0]
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr, stderr


def test_an_output_path_that_is_a_file_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    for flag in ("--tensorboard-dir", "--data-cache-path", "--save"):
        code, stderr = run_ranks(1, exit_code_and_stderr, RUN + [flag, str(tmp_path / "file")])[0]
        assert code == 2 and stderr.count("\n") == 1, stderr
        assert f"{flag} {tmp_path / 'file'} is not a writable directory" in stderr


@pytest.mark.parametrize("scale", [["--loss-scale", "1e30"], ["--initial-loss-scale", "1e30", "--min-loss-scale",
                                                               "1e30"]])
def test_fp16_stuck_at_the_minimum_loss_scale_stops_before_saving(tmp_path, scale):
    argv = RUN + ["--fp16", "--train-iters", "20", "--save", str(tmp_path / "ckpt"), "--save-interval", "100"] + scale
    code, stderr = run_ranks(1, exit_code_and_stderr, argv)[0]
    assert code == 1 and stderr.count("\n") == 1
    assert "overflowed at the minimum loss scale 1e+30 for 10 iterations in a row (iteration 10)" in stderr
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_a_flag_error_under_several_ranks_is_said_once(tmp_path):
    results = run_ranks(2, exit_code_and_stderr, RUN + ["--lr", "-1"])
    assert [code for code, _ in results] == [2, 2]
    assert results[0][1].startswith("error: --lr -1.0 is out of range") and results[1][1] == ""


def test_valid_flags_still_train(tmp_path):
    history, _ = run_ranks(1, main_capturing_stdout, RUN + ["--tensorboard-dir", str(tmp_path / "tb")])[0]
    assert len(history["losses"]) == 10


@pytest.mark.parametrize("data,split,message", [
    (["nan", "A", "1", "B"], "1,0,0", "--data-path weights [nan, 1.0] must be finite numbers"),
    (["inf", "A", "1", "B"], "1,0,0", "--data-path weights [inf, 1.0] must be finite numbers"),
    (["A"], "nan,1,0", "--split 'nan,1,0' holds a weight that is not a finite number"),
    (["0.5", "A", "0.5", "A.bin"], "1,0,0", "--data-path lists A twice (as A and A.bin)"),
])
def test_data_arguments_are_checked_before_any_file_is_opened(tmp_path, data, split, message):
    argv = [a for a in RUN if a != "--mock-data"] + ["--tokenizer-type", "NullTokenizer", "--split", split,
                                                     "--data-path", *data]
    code, stderr = run_ranks(1, exit_code_and_stderr, argv)[0]
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr


def _rule_flags():
    """(rule name, flag, a value other than its default) for every update rule's own flags (their add_flags)."""
    import argparse
    from mpzero.optim import RULES
    found = []
    for name, rule in RULES.items():
        own = argparse.ArgumentParser(add_help=False)
        rule.add_flags(own.add_argument_group())
        found += [(name, action.option_strings[0], str(action.default / 2)) for action in own._actions]
    return found


def test_a_flag_of_an_update_rule_the_run_does_not_use_is_one_line():
    """Every rule's flag, given a value other than its default under every other --optimizer: one line naming the
    flag and both rules (the run would ignore it); under its own rule it is taken."""
    from mpzero.optim import RULES
    cases = 0
    for rule, flag, value in _rule_flags():
        for chosen in RULES:
            argv = RUN + ["--optimizer", chosen, flag, value]
            if chosen == rule:
                parse_args(argv)
                continue
            with pytest.raises(ConfigError) as error:
                parse_args(argv)
            assert str(error.value).startswith(f"{flag} {float(value)} is --optimizer {rule}'s, and this run's "
                                               f"--optimizer is {chosen}"), str(error.value)
            cases += 1
    assert cases >= 4  # --adam-beta1, --adam-beta2, --adam-eps with sgd; --sgd-momentum with adam
