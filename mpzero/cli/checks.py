"""The one validation layer every entry point's flags go through (pretrain_gpt.py and tools/*.py): each value
is checked by its flag's declared type while argv is parsed, so a bad value is one `error:` line naming the
flag before anything is built, read or created.

    Number(int, low=1)                  an integer >= 1 ("64.0", "1e3", "nan" and booleans are no integers)
    Number(float, low=0.0, high=1.0, high_ok=False)   a finite number in [0, 1)
    Path("file", exists=True, text=True)             an existing UTF-8 text file (a directory is refused)
    Path("dir", writable=True)          a directory this process can create or write, checked without creating it
    Text()                              a non-empty string
    Items(Number(int, low=1))           a comma-separated list, each item checked

A type's fields state what it admits, so tests read the range from the flag itself (tests/test_fuzz_flags.py).
`Parser` is argparse with one-line errors: `error: <flag> <value> <why>` and exit code 2, never usage text.
Values from a `--config` file reach the same types as Python values (mpzero/cli/config_file.py), typed
strictly: 64.0 is not an int, a bool is not a number.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

from mpzero.errors import excerpt


class CheckError(Exception):
    """A value its flag's type refuses; the message starts with the value, the parser puts the flag first."""


@dataclass(frozen=True)
class Number:
    kind: type  # int or float
    low: float | None = None
    low_ok: bool = True  # the bound itself is allowed
    high: float | None = None
    high_ok: bool = False

    @property
    def __name__(self) -> str:  # argparse names a type by it in a few messages
        return "integer" if self.kind is int else "number"

    def __call__(self, value):
        return self.check(self.convert(value))

    def convert(self, value):
        """The value as `kind`: text from argv, or a Python value from a --config file."""
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise CheckError(f"{excerpt(value)} is not {'an integer' if self.kind is int else 'a number'}")
        if isinstance(value, str):
            try:  # ASCII only: int() and float() also read other scripts' digits ("٢")
                if not value.isascii():
                    raise ValueError(value)
                value = int(value.strip(), 10) if self.kind is int else float(value)
            except ValueError:  # argparse's own wording for a value of another type
                raise CheckError(f"invalid {self.kind.__name__} value: {excerpt(value)}") from None
        if self.kind is int and not isinstance(value, int):
            raise CheckError(f"{excerpt(value)} is not an integer")
        try:
            return self.kind(value)
        except OverflowError:  # an integer of thousands of digits for a float flag
            raise CheckError(f"{excerpt(value)} must be a finite number") from None

    def check(self, value):
        """`value` (already of `kind`) if finite and within the bounds, else CheckError saying why."""
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckError(f"{value} must be a finite number")  # nan, inf: short
        if isinstance(value, int) and not -2 ** 63 <= value < 2 ** 63:  # no count or size of a run is larger
            raise CheckError(f"{excerpt(value)} is out of range: it must fit in 64 bits")
        too_low = self.low is not None and (value < self.low or (value == self.low and not self.low_ok))
        too_high = self.high is not None and (value > self.high or (value == self.high and not self.high_ok))
        if too_low or too_high:
            raise CheckError(f"{excerpt(value)} is out of range: it must be {self.range_text()}")
        return value

    def range_text(self) -> str:
        lower = "" if self.low is None else f"{'>=' if self.low_ok else '>'} {self.low}"
        upper = "" if self.high is None else f"{'<=' if self.high_ok else '<'} {self.high}"
        return " and ".join(b for b in (lower, upper) if b) or "finite"


UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30,
         "tib": 2 ** 40, "": 2 ** 30}  # a bare number is GiB


@dataclass(frozen=True)
class Size(Number):
    """Bytes (or bytes per second) written with a unit: 80GiB, 1.5TB, 25GB; a bare number is GiB."""

    kind: type = float
    low: float | None = 0.0
    low_ok: bool = False

    @property
    def __name__(self) -> str:
        return "size"

    def convert(self, value):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise CheckError(f"{excerpt(value)} is not a size (e.g. 80GiB, 1.5TB, 32)")
        if not isinstance(value, str):
            return float(value)
        match = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[-+]?[0-9]+)?|[-+]?nan|[-+]?inf)\s*([a-zA-Z]*)\s*", value,
                             re.IGNORECASE) if value.isascii() else None
        if not match or match.group(2).lower() not in UNITS:
            raise CheckError(f"{excerpt(value)} is not a size (e.g. 80GiB, 1.5TB, 32)")
        try:
            return float(match.group(1)) * UNITS[match.group(2).lower()]
        except ValueError:
            raise CheckError(f"{excerpt(value)} is not a size (e.g. 80GiB, 1.5TB, 32)") from None


@dataclass(frozen=True)
class Choice:
    """One of `values` (inside an Items list; a flag of its own takes argparse's choices)."""

    values: tuple

    __name__ = "choice"

    def __call__(self, value):
        if value not in self.values:
            raise CheckError(f"{excerpt(value)} is not one of {', '.join(map(str, self.values))}")
        return value


@dataclass(frozen=True)
class Text:
    """A non-empty string (names, prefixes, specs whose own syntax is checked where they are parsed);
    empty_ok: any string (a prompt)."""

    empty_ok: bool = False

    __name__ = "text"

    def __call__(self, value):
        if not isinstance(value, str):
            raise CheckError(f"{excerpt(value)} is not a string")
        if not self.empty_ok and not value.strip():
            raise CheckError("is empty: give a value or drop the flag")
        return value


PATH_MAX = 4096  # Linux's longest path


@dataclass(frozen=True)
class Path:
    """A path checked without creating or changing anything. kind: "file", "dir" or "any" (either);
    exists: it must be there now; writable: this process may create it (or write into the directory) at that
    path; text: a file whose contents must decode as UTF-8."""

    kind: str = "any"
    exists: bool = True
    writable: bool = False
    text: bool = False

    __name__ = "path"

    def __call__(self, value):
        path = Text()(value)
        if len(path) > PATH_MAX or "\0" in path:
            raise CheckError(f"{excerpt(path)} is no path ({len(path)} characters{', a NUL' if chr(0) in path else ''})"
                             f": give a real one")
        if os.path.exists(path):
            self._check_existing(path)
        elif self.exists:
            raise CheckError(f"{path}: no such {'directory' if self.kind == 'dir' else 'file'}")
        else:
            self._check_creatable(path)
        return path

    def _check_existing(self, path: str) -> None:
        if self.kind == "file" and os.path.isdir(path):
            raise CheckError(f"{path} is a directory: name a file")
        if self.kind == "dir" and not os.path.isdir(path):
            raise CheckError(f"{path} is not a writable directory (not a directory): choose a directory"
                             if self.writable else f"{path} is not a directory: name a directory")
        if not os.access(path, os.R_OK):
            raise CheckError(f"{path} cannot be read (permission denied)")
        if self.writable and not os.access(path, os.W_OK | (os.X_OK if os.path.isdir(path) else 0)):
            raise CheckError(f"{path} is not writable (permission denied): choose a path this run can write")
        if self.text and os.path.isfile(path):
            _check_utf8(path)

    def _check_creatable(self, path: str) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            what = "a writable directory" if self.kind == "dir" else "a path that can be created"
            raise CheckError(f"{path} is not {what} ({parent} is a file): choose another path")
        if self.writable and not os.access(parent, os.W_OK | os.X_OK):
            raise CheckError(f"{path} cannot be created ({parent} is not writable): choose a path this run can "
                             f"write")


def _check_utf8(path: str) -> None:
    import codecs
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                decoder.decode(block)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        raise CheckError(f"{path} is not UTF-8 text ({error_reason(error)}): give a text file") from None


@dataclass(frozen=True)
class Items:
    """A comma-separated list ("1,2,4"), each item through `item`; empty items are refused."""

    item: object

    __name__ = "list"

    def __call__(self, value):
        parts = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, list) else None
        if not parts or any(isinstance(p, str) and not p.strip() for p in parts):
            raise CheckError(f"{excerpt(value)} is not a comma-separated list (e.g. 1,2,4)")
        return [self.item(p) for p in parts]


ITERATION = Number(int, low=0)  # a checkpoint's iteration
SEED = Number(int, low=0, high=2 ** 32)  # what torch.manual_seed and numpy take
OUTPUT_PREFIX = Path("any", exists=False, writable=True)  # PREFIX.bin/.idx, PREFIX.model...: its directory is checked


def add_tokenizer_flags(parser: argparse.ArgumentParser, default_help: str | None, required: bool = False) -> None:
    """Megatron's four tokenizer flags of the tools. Non-empty text here: the tokenizer builder checks the type
    and the files it needs together (`unknown --tokenizer-type`, `the checkpoint's tokenizer: --tokenizer-model
    ... does not exist`), naming which tokenizer wanted them."""
    parser.add_argument("--tokenizer-type", type=Text(), required=required, default=None,
                        help=default_help or "GPTSentencePieceTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer | "
                                             "NullTokenizer")
    parser.add_argument("--tokenizer-model", type=Text(), default=None, help=default_help or (
        "SentencePiece model (GPTSentencePieceTokenizer), or a tokenizer.json or its directory (HuggingFaceTokenizer)"))
    parser.add_argument("--vocab-file", type=Text(), default=None,
                        help=default_help or "GPT-2 vocab.json (GPT2BPETokenizer)")
    parser.add_argument("--merge-file", type=Text(), default=None,
                        help=default_help or "GPT-2 merges.txt (GPT2BPETokenizer)")


def error_reason(error: BaseException) -> str:
    """An OSError's or decoding error's reason in a few words (no traceback, no repr of the bytes)."""
    if isinstance(error, UnicodeDecodeError):
        return f"byte {error.start} is not UTF-8"
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def flag_name(action: argparse.Action) -> str:
    """The flag named after the destination (--layernorm-epsilon, not its alias --norm-epsilon)."""
    own = "--" + action.dest.replace("_", "-")
    return own if own in action.option_strings else (action.option_strings or [action.dest])[0]


class Parser(argparse.ArgumentParser):
    """argparse whose every error is one line: `error: ...` on stderr, exit code 2 (`fail` may raise instead)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # --lr never means --lr-decay-style
        super().__init__(*args, **kwargs)

    def fail(self, message: str):
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def error(self, message: str):
        self.fail(f"{message} (see --help)")

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except CheckError as error:
            self.fail(f"{flag_name(action)} {error}")
