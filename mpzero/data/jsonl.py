"""Streaming JSONL input for the data tools: one document per line, plain or gzip, read in bounded batches
(parquet files, by suffix, through parquet.py's batches of rows, which have the same two methods).

A line is malformed if it is not UTF-8, not a JSON object, or lacks a requested key whose value is a
string (or a list of strings: pre-split sentences). Blank lines are ignored. Errors name file and line.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass

from mpzero.errors import ConfigError


class MalformedLine(ValueError):
    pass


@dataclass
class LineBatch:
    """Consecutive raw lines of one file: lines[k] is line number first_line + k (1-based)."""
    path: str
    first_line: int
    lines: list[bytes]
    nbytes: int

    def location(self, number: int) -> str:
        return f"{self.path}:{number}"

    def documents(self, keys: list[str]):
        """(line number, {key: [text, ...]} or None, reason or None) per line: a blank line has neither a
        document nor a reason; a malformed one its reason."""
        for k, line in enumerate(self.lines):
            try:
                yield self.first_line + k, parse_line(line, keys), None
            except MalformedLine as exc:
                yield self.first_line + k, None, str(exc)


def check_inputs(paths: list[str]) -> list[str]:
    """The input files (directories and globs of parquet files expanded: parquet.py), each checked to exist."""
    from mpzero.data.parquet import expand_inputs

    files = expand_inputs(paths)
    for path in files:
        if not os.path.isfile(path):
            raise ConfigError(f"--input {path} does not exist: give a JSONL file (optionally .gz) or parquet files")
    return files


def open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_batches(paths: list[str], max_lines: int = 256, max_bytes: int = 1 << 20, keys: list[str] = ("text",)):
    """Yield LineBatch objects of at most max_lines lines / about max_bytes bytes, files in order; a parquet
    file's rows as RowBatch objects of max_lines rows, its `keys` columns only (parquet.py)."""
    from mpzero.data.parquet import is_parquet, read_row_batches

    for path in paths:
        if is_parquet(path):
            yield from read_row_batches(path, list(keys), max_lines)
            continue
        with open_binary(path) as f:
            lines, nbytes, first = [], 0, 1
            try:
                for number, line in enumerate(f, start=1):
                    lines.append(line)
                    nbytes += len(line)
                    if len(lines) >= max_lines or nbytes >= max_bytes:
                        yield LineBatch(path, first, lines, nbytes)
                        lines, nbytes, first = [], 0, number + 1
            except (OSError, EOFError) as exc:  # a corrupt or truncated .gz stream
                raise ConfigError(f"{path}: cannot read past line {first + len(lines) - 1} ({exc})") from None
            if lines:
                yield LineBatch(path, first, lines, nbytes)


def parse_line(line: bytes, keys: list[str]) -> dict[str, list[str]] | None:
    """{key: [text, ...]} for one line, None for a blank line; raises MalformedLine with the reason."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedLine(f"invalid UTF-8 at byte {exc.start}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.isspace() or not text:  # checked only on failure: most lines are not blank
            return None
        raise MalformedLine(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise MalformedLine(f"not a JSON object (got a {type(obj).__name__})")
    out = {}
    for key in keys:
        if key not in obj:
            raise MalformedLine(f"no key {key!r} (keys: {', '.join(list(obj)[:5])})")
        value = obj[key]
        if isinstance(value, str):
            out[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[key] = value
        else:
            raise MalformedLine(f"key {key!r} is not a string (got {type(value).__name__})")
    return out


def iter_texts(paths: list[str], keys: list[str], skip_malformed: bool, skipped: list[str]):
    """Every string of every requested key, line by line; malformed lines raise, or with
    skip_malformed are appended to `skipped` as 'file:line: reason'."""
    for batch in read_batches(check_inputs(paths), keys=keys):
        for number, doc, reason in batch.documents(keys):
            if reason is not None:
                where = f"{batch.location(number)}: {reason}"
                if not skip_malformed:
                    raise ConfigError(f"{where}; fix or remove the line, or pass --skip-malformed") from None
                skipped.append(where)
                continue
            for texts in (doc or {}).values():
                yield from texts
