"""Finding a checkpoint and checking its small files before any tensor is read: the latest pointer, meta.json
(every key and value), DCP's .metadata and the .distcp shards' sizes. Each problem is one ConfigError line naming
the checkpoint, the file, and the previous iteration to load instead (`previous_advice`). Saving, loading and the
tools (verify.py, consolidated.py, tools/) read checkpoints through these.
"""

from __future__ import annotations

import json
import os

from torch.distributed.checkpoint.metadata import Metadata

from mpzero.checkpointing.checksums import ALGORITHMS
from mpzero.checkpointing.format import FORMAT, LATEST, checkpoint_dir, published_dir
from mpzero.checkpointing.reader import ADMITTED, ForeignClassError, error_reason, read_metadata
from mpzero.errors import ConfigError, excerpt


POINTER_BYTES = 32  # an iteration number and its line end; Megatron's pointer holds a few digits


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:  # a few bytes: a pointer of millions of digits is not read whole
        data = f.read(POINTER_BYTES + 1)
    text = data.decode("utf-8", errors="replace").strip()  # bytes: a non-UTF-8 file is one line too
    if len(data) > POINTER_BYTES or not (text.isascii() and text.isdigit()):
        held = f"over {POINTER_BYTES} bytes" if len(data) > POINTER_BYTES else excerpt(text)
        raise ConfigError(f"{path} holds {held}, not an iteration number: fix or delete it")
    return int(text)


def read_meta(root: str) -> tuple[str, dict] | None:
    """(directory, meta.json contents) of the latest checkpoint under `root`, or None when there is none; reads
    no tensors, so a run can size its data from the checkpoint's consumed samples before building anything."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    directory = published_dir(root, iteration)
    advice = previous_advice(root, iteration)
    meta = read_meta_file(directory, advice)
    missing = next((key for key in RESUME_KEYS if key not in meta), None)
    if missing is not None:
        raise ConfigError(f"checkpoint {directory}: meta.json is damaged (no {missing!r}, which resuming needs): "
                          f"{advice}")
    return directory, meta


def previous_advice(root: str, iteration: int) -> str:
    """What to do about a damaged checkpoint of `iteration`: load the latest complete one before it."""
    earlier = [n for n in _complete_iterations(root) if n < iteration]
    if not earlier:
        return f"restore it from a copy; there is no earlier checkpoint under {root}"
    n = max(earlier)
    return (f"load the previous iteration ({os.path.basename(checkpoint_dir(root, n))}: put {n} in "
            f"{os.path.join(root, LATEST)})")


def _complete_iterations(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [int(name[len("iter_"):]) for name in names
            if name.startswith("iter_") and name[len("iter_"):].isdigit() and os.path.isdir(os.path.join(root, name))]


def read_meta_file(directory: str, advice: str) -> dict:
    """meta.json of the checkpoint in `directory`; missing, damaged or from a newer mpzero: one ConfigError line."""
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint {directory} is missing (the latest pointer names it): {advice}")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {directory}: meta.json is missing (not an mpzero checkpoint, or damaged): "
                          f"{advice}") from None
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "not valid JSON"
        raise ConfigError(f"checkpoint {directory}: meta.json is unreadable ({reason}): {advice}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint {directory}: meta.json is damaged (not a JSON object): {advice}")
    problem = _meta_problem(meta)
    if problem is not None:
        raise ConfigError(f"checkpoint {directory}: meta.json is damaged ({problem}): {advice}")
    if meta.get("format", 1) > FORMAT:
        # formats 1 (no field), 2 and 3 store the same keys; 3 adds checksums
        raise ConfigError(f"{directory} is in checkpoint format {meta['format']}, newer than this mpzero's "
                          f"({FORMAT}): load it with the mpzero that wrote it")
    return meta


# meta.json's keys: (type, required), every value checked before any reader uses it. Optional keys are absent
# from older formats (1 had no format, checksums, architecture, tokenizer); a key present has its type.
META_KEYS = {"iteration": (int, True), "consumed_samples": (int, False), "skipped_iterations": (int, False),
             "shapes": (dict, True), "layout": (dict, True), "format": (int, False), "config": (dict, False),
             "architecture": (dict, False), "checksums": (str, False), "optimizer": (dict, False),
             "lr_schedule": (dict, False), "tokenizer": (dict, False)}
RESUME_KEYS = ("consumed_samples", "skipped_iterations")  # what a resumed run reads besides the required keys


def _meta_problem(meta: dict) -> str | None:
    """What is wrong with meta.json's keys and values, or None."""
    for key, (kind, required) in META_KEYS.items():
        if key not in meta:
            if required:
                return f"no {key!r}"
            continue
        value = meta[key]
        if value is None and key == "tokenizer":  # recorded as unknown (tokenizer_identity.py says so in a note)
            continue
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < (key == "format")):
            return f"its \"{key}\" is {value!r}, not {_KIND_NAMES[kind]}"
    if "checksums" in meta and meta["checksums"] not in ALGORITHMS:
        return f"checksums is {meta['checksums']!r}, not one of {', '.join(ALGORITHMS)}"
    layout = meta["layout"]
    if "checksums" in meta and "world" not in layout:  # the checksum files are per rank of that world
        return "no layout's 'world', which its checksums need"
    for key in ("world", "tp", "dp"):
        value = layout.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"layout's {key} is {value!r}, not a positive integer"
    for name, shape in meta["shapes"].items():
        if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                for n in shape)):
            return f"the shape of {name} is {shape!r}, not a list of sizes"
    return None


_KIND_NAMES = {int: "a non-negative integer", dict: "a JSON object", str: "a string"}


def read_dcp_metadata(directory: str, advice: str, admitted: frozenset[tuple[str, str]] = ADMITTED) -> Metadata:
    """DCP's .metadata (the stored chunks and where they lie), read without running anything it names (see
    reader.py; `admitted`: the classes it may name); missing, damaged or naming a foreign class: one ConfigError
    line."""
    try:
        metadata = read_metadata(directory, admitted)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {directory}: .metadata is missing: {advice}") from None
    except ForeignClassError as error:
        raise ConfigError(f"checkpoint {directory}: .metadata is refused: {error} (loading it could run code): "
                          f"not read; use only checkpoints from a source you trust") from None
    except Exception as error:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise ConfigError(f"checkpoint {directory}: .metadata is unreadable ({error_reason(error)}): "
                          f"{advice}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ConfigError(f"checkpoint {directory}: .metadata is damaged (not DCP metadata): {advice}")
    return metadata


def check_shard_files(directory: str, metadata: Metadata, advice: str) -> None:
    """Every .distcp file the metadata points into exists and is long enough for the chunks stored in it."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
        if isinstance(path, str) and isinstance(offset, int) and isinstance(length, int):
            needed[path] = max(needed.get(path, 0), offset + length)
    for name, size in sorted(needed.items()):
        try:
            have = os.path.getsize(os.path.join(directory, name))
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {directory}: {name} is missing: {advice}") from None
        if have < size:
            raise ConfigError(f"checkpoint {directory}: {name} is truncated ({have} of at least {size} bytes): "
                              f"{advice}")
