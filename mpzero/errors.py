"""The one error type for bad user input: its message is a single line naming the problem and the fix, and any
value it quotes is an `excerpt`: bounded, whatever the size of the value a user (or an attacker) gave."""

import reprlib


class ConfigError(ValueError):
    """Raised for inconsistent settings or bad input files; entry points print it as one line and exit 2."""


class TrainingError(RuntimeError):
    """A run that cannot go on (a NaN loss, a dead peer): one line naming the iteration and the rank; exit 1."""


class _Bounded(reprlib.Repr):
    """reprlib's size-limited repr; an integer too long for str() is described, not converted."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 2, 60, 60, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x, level):
        try:
            return super().repr_int(x, level)
        except ValueError:  # beyond sys.get_int_max_str_digits()
            return f"<an integer of {x.bit_length()} bits>"


_BOUNDED = _Bounded()
EXCERPT_CHARS = 80


def shorten(text: str, limit: int = 200) -> str:
    """`text` in at most `limit` characters (cut with `...`): a library's error message, quoted in ours."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """repr(value) in at most `limit` characters (cut with `...`), made without building the whole repr of a
    large value: what an error message quotes of a value it refuses."""
    text = _BOUNDED.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
