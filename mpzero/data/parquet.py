"""Parquet input for the data tools (FineWeb and FineWeb-Edu ship as parquet): the `--json-keys` columns read with
pyarrow in row-group batches, as the JSONL reader's batches of lines (jsonl.py) are, so preprocessing's worker
pool, progress bar and outputs are the same, and the same documents give the same .bin/.idx bytes.

A text column is a string (one document per row) or a list of strings (pre-split sentences). A missing column,
another type, or a file that is not parquet is one line naming the file; a null value is a malformed row (its
1-based row number; --skip-malformed skips it). pyarrow is an optional package (`pip install -e '.[parquet]'`),
imported only when a .parquet input is given; it is never needed for training.
"""

from __future__ import annotations

import glob
import itertools
import os
from dataclasses import dataclass

from mpzero.errors import ConfigError

SUFFIX = ".parquet"


def is_parquet(path: str) -> bool:
    return path.endswith(SUFFIX)


def expand_inputs(paths: list[str]) -> list[str]:
    """--input as files: a directory is every .parquet file under it (sorted, recursively, as FineWeb's
    data/CC-MAIN-*/000_00000.parquet), a pattern that names no file is a glob (`**` recursive), sorted. What a
    directory or glob finds is read once, by its real path, however many names (links, a `latest -> snapshot`
    directory, another --input) lead to it; a link back to a directory above it (a cycle) is one ConfigError line.
    A file named itself is read as often as it is named."""
    files, seen = [], set()
    for path in paths:
        if os.path.isdir(path):
            found = sorted(_files_under(path, path))
            if not found:
                raise ConfigError(f"--input {path} is a directory with no {SUFFIX} files in it")
        elif not os.path.exists(path) and glob.has_magic(path):
            if "**" in path:  # a recursive glob follows linked directories: refuse a cycle before it loops
                _files_under(_static_prefix(path), path)
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise ConfigError(f"--input {path} matches no file")
        else:
            seen.add(os.path.realpath(path))
            files.append(path)
            continue
        for file in found:
            if os.path.realpath(file) not in seen:
                seen.add(os.path.realpath(file))
                files.append(file)
    return files


def _files_under(root: str, given: str) -> list[str]:
    """Every .parquet file under the directory `root`, linked directories followed, each directory walked once
    (by its real path); a link to a directory that contains it is a cycle: a ConfigError naming --input `given`."""
    found, walked = [], set()

    def walk(directory: str, above: tuple[str, ...]) -> None:
        real = os.path.realpath(directory)
        if real in above:
            raise ConfigError(f"--input {given}: {directory} leads back to {real}, a directory above it (a cycle of "
                              f"symbolic links): remove the link, or name the directories to read")
        if real in walked:  # reached again through another link: its files are listed already
            return
        walked.add(real)
        try:
            entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
        except OSError as error:
            raise ConfigError(f"--input {given}: {directory} cannot be listed ({error.strerror})") from None
        for entry in entries:
            if entry.is_dir():
                walk(entry.path, above + (real,))
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                found.append(entry.path)

    walk(root, ())
    return found


def _static_prefix(pattern: str) -> str:
    """The directory a glob pattern starts in: its leading components without magic."""
    parts = pattern.split(os.sep)
    static = [part for part in itertools.takewhile(lambda part: not glob.has_magic(part), parts)]
    return os.sep.join(static) or (os.sep if pattern.startswith(os.sep) else ".")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet  # noqa: F401 - the submodules are used through `pyarrow`
    except ImportError:
        raise ConfigError("parquet input needs pyarrow, which is not installed: pip install -e '.[parquet]'") \
            from None
    return pyarrow


@dataclass
class RowBatch:
    """Consecutive rows of one parquet file, the requested columns only: row first_line + k (1-based) is
    element k of each column, as Python values (str, list of str or None; made in the reading process, so the
    workers never import pyarrow). `nbytes`: the text's UTF-8 bytes."""
    path: str
    first_line: int
    columns: dict[str, list]
    nbytes: int

    def location(self, number: int) -> str:
        return f"{self.path}: row {number}"

    def documents(self, keys: list[str]):
        """(row number, {key: [text, ...]} or None, reason or None) per row, as LineBatch.documents."""
        values = self.columns
        for k in range(len(values[keys[0]]) if keys else 0):
            doc, reason = {}, None
            for key in keys:
                value = values[key][k]
                if value is None or (isinstance(value, list) and any(v is None for v in value)):
                    reason = f"key {key!r} is null"
                    break
                doc[key] = value if isinstance(value, list) else [value]
            yield self.first_line + k, (None if reason else doc), reason


def _check_column(path: str, schema, key: str, pa) -> None:
    if key not in schema.names:
        raise ConfigError(f"{path}: no column {key!r} (columns: {', '.join(schema.names[:8])}): pass the text "
                          f"column with --json-keys")
    kind = schema.field(key).type
    texts = (pa.types.is_string, pa.types.is_large_string)
    if not (any(t(kind) for t in texts) or (pa.types.is_list(kind) or pa.types.is_large_list(kind))
            and any(t(kind.value_type) for t in texts)):
        raise ConfigError(f"{path}: column {key!r} is {kind}, not a string (or a list of strings)")


def read_row_batches(path: str, keys: list[str], max_rows: int):
    """RowBatch objects of at most max_rows rows, in row order (pyarrow reads row group by row group)."""
    pa = _pyarrow()
    try:
        reader = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path} is not a readable parquet file ({str(exc).splitlines()[0][:200]})") from None
    schema = reader.schema_arrow
    for key in keys:
        _check_column(path, schema, key, pa)
    first = 1
    with reader:
        try:
            for batch in reader.iter_batches(batch_size=max_rows, columns=list(dict.fromkeys(keys))):
                columns = {key: batch.column(key) for key in keys}
                nbytes = sum(_text_bytes(c, pa) for c in columns.values())
                yield RowBatch(path, first, {key: c.to_pylist() for key, c in columns.items()}, nbytes)
                first += batch.num_rows
        except (pa.ArrowException, OSError) as exc:  # a damaged row group
            raise ConfigError(f"{path}: cannot read past row {first - 1} ({str(exc).splitlines()[0][:200]})") \
                from None


def _text_bytes(column, pa) -> int:
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        column = column.flatten()
    return int(pa.compute.sum(pa.compute.binary_length(column)).as_py() or 0)
