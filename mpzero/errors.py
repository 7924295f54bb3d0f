"""The one error type for bad user input: its message is a single line naming the problem and the fix."""


class ConfigError(ValueError):
    """Raised for inconsistent settings or bad input files; entry points print it as one line and exit 2."""


class TrainingError(RuntimeError):
    """A run that cannot go on (a NaN loss, a dead peer): one line naming the iteration and the rank; exit 1."""
