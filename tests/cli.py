"""Running `pretrain_gpt.main` inside test ranks: a tiny model's flags and ways to capture what it says."""

import contextlib
import io
import os
import re

import pretrain_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "300",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "5"]
LINE = re.compile(r" iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| .* \| lm loss: (\S+) \| "
                  r"loss scale: \S+ \| grad norm: (\S+) \|")


def main_capturing_stdout(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = pretrain_gpt.main(argv)
    return history, out.getvalue()


def quiet_main(argv):
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain_gpt.main(argv)


def exit_code_and_stderr(argv):
    """(exit code, stderr) of a run expected to stop with SystemExit; (0, stderr) if it finishes."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            pretrain_gpt.main(argv)
        except SystemExit as exit_:
            return exit_.code, err.getvalue()
    return 0, err.getvalue()


def tool_result(main, argv):
    """(exit code, stderr) of a tool's main(argv) run in this process (a SystemExit's code as the process would
    exit with it: None 0, a message 1)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    return (code if isinstance(code, int) else 1 if code else 0), err.getvalue()


def assert_close_lists(a, b, rel=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


def fuzz_outcome(main, argv) -> tuple[object, str]:
    """(exit code, stderr) of main(argv) in this process for the fuzz tests: a SystemExit's code as it is, a
    returned non-int (pretrain_gpt's and generate's results) 0, and an exception escaping main reported as a
    traceback line in stderr (so the test names it instead of stopping)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
            code = code if isinstance(code, int) else 0
        except SystemExit as stop:
            code = stop.code
        except Exception as error:  # noqa: BLE001 - what escapes main is a traceback: reported as such
            return 1, f"{err.getvalue()}Traceback: {type(error).__name__}: {error}\n"
    return code, err.getvalue()


def tree_snapshot(root) -> set[str]:
    """Every file and folder below `root` (what a refused command must leave as it was)."""
    return {os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files}
