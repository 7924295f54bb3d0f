"""The one way a command-line entry point reports bad input: `error: <one line>` on stderr and a non-zero exit,
no traceback (a bug, any other exception, keeps its traceback)."""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from mpzero.errors import ConfigError, TrainingError

T = TypeVar("T")
EXIT_CODES = {ConfigError: 2, TrainingError: 1}  # bad input: 2; a run that cannot go on: 1
INPUT_ERRORS = {ConfigError: 2, OSError: 2}  # file tools: an unreadable input or unwritable output is bad input


def print_error(message: object) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_or_exit(fn: Callable[[], T], codes: dict[type[BaseException], int] | None = None) -> T:
    """fn(); an exception of a type in `codes` (default EXIT_CODES) prints its one line and raises
    SystemExit with that type's code."""
    codes = EXIT_CODES if codes is None else codes
    try:
        return fn()
    except tuple(codes) as error:
        print_error(error)
        raise SystemExit(next(code for kind, code in codes.items() if isinstance(error, kind))) from None


def exit_code(fn: Callable[[], object], codes: dict[type[BaseException], int] | None = None) -> int:
    """For a `main() -> int`: 0 after fn(), or the code run_or_exit would exit with."""
    try:
        run_or_exit(fn, codes)
    except SystemExit as stop:
        return int(stop.code)
    return 0
