"""The command line: the only layer that knows argv. Megatron's flags (`arguments`), `--config` files read
through the same types (`config_file`), every number's range (`flag_ranges`), the typed checks every flag's
value goes through (`checks`), the one-line `error:` exit every entry point uses (`exits`) and `--dry-run`
(`mpzero.cli.dry_run`, imported by its path: the function shares the module's name). Entry points
(pretrain_gpt.py, tools/) import from here; the library below never parses argv.

The checks and the exits are imported at once (stdlib only: tools that never build a model stay light); the
flag functions on first use, since they pull in every config section (models, training, ZeRO) and the
library's own packages import this module's exits without that cost or an import cycle.
"""

from mpzero.cli.checks import (ITERATION, OUTPUT_PREFIX, SEED, CheckError, Choice, Items, Number, Parser, Path, Size,
                               Text, add_tokenizer_flags)
from mpzero.cli.exits import EXIT_CODES, INPUT_ERRORS, exit_code, print_error, run_or_exit

_LAZY = {"build_parser": "arguments", "parse_args": "arguments", "run_config": "arguments",
         "gpt_config": "arguments", "zero_config": "arguments", "offload_config": "arguments",
         "optimizer_config": "arguments", "precision_config": "arguments", "tokenizer_record": "arguments",
         "read_config_file": "config_file", "check_ranges": "flag_ranges", "RANGES": "flag_ranges"}

__all__ = ["ITERATION", "OUTPUT_PREFIX", "SEED", "CheckError", "Choice", "Items", "Size", "Number", "Parser",
           "Path", "Text", "add_tokenizer_flags", "EXIT_CODES", "INPUT_ERRORS", "exit_code", "print_error",
           "run_or_exit",  # and, loaded on first use (_LAZY):
           "build_parser", "parse_args", "run_config", "gpt_config", "zero_config", "offload_config",
           "optimizer_config", "precision_config", "tokenizer_record", "read_config_file", "check_ranges", "RANGES"]
assert set(__all__) >= set(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mpzero.cli' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"mpzero.cli.{_LAZY[name]}"), name)
