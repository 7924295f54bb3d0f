"""The command line: the only layer that knows argv. Megatron's flags (`arguments`), `--config` files read
through the same types (`config_file`), every number's range (`flag_ranges`), the typed checks every flag's
value goes through (`checks`), the one-line `error:` exit every entry point uses (`exits`) and `--dry-run`
(`dry_run`). Entry points (pretrain_gpt.py, tools/) import from here; the library below never parses argv.

This face holds the checks and the exits (stdlib only), so that tools which never build a model start without
torch; the flag functions live in `mpzero.cli.arguments` (they pull in every config section: models, training,
ZeRO, the planner), imported from there by pretrain_gpt.py and tools/plan_memory.py.
"""

from mpzero.cli.checks import (ITERATION, OUTPUT_PREFIX, SEED, CheckError, Choice, Items, Number, Parser, Path, Size,
                               Text, add_tokenizer_flags)
from mpzero.cli.exits import EXIT_CODES, INPUT_ERRORS, exit_code, print_error, run_or_exit

__all__ = ["ITERATION", "OUTPUT_PREFIX", "SEED", "CheckError", "Choice", "Items", "Size", "Number", "Parser",
           "Path", "Text", "add_tokenizer_flags", "EXIT_CODES", "INPUT_ERRORS", "exit_code", "print_error",
           "run_or_exit"]
