"""Which tokenizer made a run's token ids: recorded with every checkpoint and beside every preprocessed dataset,
and compared when a run resumes or opens its data.

Token ids mean nothing without their tokenizer: a checkpoint trained with one SentencePiece model and resumed on
data from another of the same vocabulary size trains on with no error (every shape agrees), learning other text
into the same embedding rows. Megatron compares `tokenizer_type` on load; mpzero compares the files too:

    {"type": "GPTSentencePieceTokenizer", "sha256": sha256 of the .model file, "vocab_size": 512}
    {"type": "GPT2BPETokenizer", "sha256": of vocab.json then merges.txt (`cat vocab.json merges.txt | sha256sum`),
     "vocab_size": 50257}
    {"type": "HuggingFaceTokenizer", "sha256": of tokenizer.json (then tokenizer_config.json where its eos_token
     chose the end of document), "vocab_size": 128256}
    {"type": "NullTokenizer", "sha256": null, "vocab_size": 1001}    the text is the ids: the size says it all
    {"type": null, "sha256": null, "vocab_size": 300}                --mock-data: no tokenizer, only --vocab-size

- A checkpoint's meta.json holds the run's record under "tokenizer", with "data": {each --data-path prefix: its
  own record, null where unknown}. Resuming with another tokenizer is one ConfigError line naming both, unless
  --finetune (weights only: a new run) or --override-tokenizer-check says it is meant, each said in a note. A
  checkpoint saved before this record loads with a note.
- tools/preprocess_data.py writes PREFIX.tokenizer.json beside PREFIX.bin/.idx: the record and the sha256 of
  the .idx it describes. A file that describes another .idx (the prefix was made again by another tool) is
  ignored with a note; data without one (Megatron's own preprocessing) is unknown and not checked. A run whose
  tokenizer is not its data's is refused likewise, unless --override-tokenizer-check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

from mpzero.data.indexed_dataset import index_file_path
from mpzero.errors import ConfigError
from mpzero.files import write_atomically

SIDECAR_SUFFIX = ".tokenizer.json"
_KEYS = ("type", "sha256", "vocab_size")


def tokenizer_identity(tokenizer) -> dict:
    """The record of a tokenizer built by `build_tokenizer`: its type, the sha256 of its files, its vocabulary."""
    files = getattr(tokenizer, "files", ())
    return {"type": type(tokenizer).__name__, "sha256": _sha256(files) if files else None,
            "vocab_size": tokenizer.vocab_size}


def no_tokenizer(vocab_size: int) -> dict:
    """--mock-data's record: there is no tokenizer, only the vocabulary size the synthetic ids are drawn from."""
    return {"type": None, "sha256": None, "vocab_size": vocab_size}


def _sha256(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while piece := f.read(1 << 24):
                digest.update(piece)
    return digest.hexdigest()


def describe(record: dict) -> str:
    """'GPTSentencePieceTokenizer sha256:1a2b3c4d5e6f', 'NullTokenizer (1001 ids)', 'no tokenizer (--mock-data,
    300 ids)': the short name a one-line message gives."""
    if record["type"] is None:
        return f"no tokenizer (--mock-data, {record['vocab_size']} ids)"
    if record["sha256"] is None:
        return f"{record['type']} ({record['vocab_size']} ids)"
    return f"{record['type']} sha256:{record['sha256'][:12]}"


def same_tokenizer(a: dict, b: dict) -> bool:
    return all(a.get(key) == b.get(key) for key in _KEYS)


def _is_record(value) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("type"), (str, type(None)))
            and isinstance(value.get("sha256"), (str, type(None))) and type(value.get("vocab_size")) is int)


def check_checkpoint_tokenizer(meta: dict, here: dict | None, directory: str, finetune: bool,
                               override: bool) -> str | None:
    """None when the checkpoint in `directory` (its meta.json `meta`) was trained with the tokenizer `here`, or
    a note to print (no record, or another tokenizer under --finetune / --override-tokenizer-check); another
    tokenizer otherwise is a ConfigError naming both. `here` None (a caller that does not know it) checks nothing."""
    if here is None:
        return None
    saved = meta.get("tokenizer")
    if saved is None:
        return (f"note: {directory} records no tokenizer (saved before mpzero recorded it): not compared with this "
                f"run's {describe(here)}")
    if not _is_record(saved):
        raise ConfigError(f"checkpoint {directory}: meta.json is damaged (its \"tokenizer\" is not a tokenizer "
                          f"record): restore it from a copy, or pass --finetune to load its weights only")
    if same_tokenizer(saved, here):
        return None
    if finetune:
        return (f"note: --finetune: {directory} was trained with {describe(saved)}; its weights train on with "
                f"this run's {describe(here)}")
    if override:
        return (f"note: --override-tokenizer-check: resuming {directory}, trained with {describe(saved)}, with "
                f"{describe(here)}")
    raise ConfigError(f"checkpoint {directory} was trained with {describe(saved)}, this run has {describe(here)}: its "
                      f"token ids would mean other text; pass the tokenizer it was trained with, --finetune to "
                      f"start a new run from its weights, or --override-tokenizer-check if this is intended")


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR_SUFFIX


def write_data_tokenizer(prefix: str, record: dict) -> None:
    """PREFIX.tokenizer.json for the complete PREFIX.idx just written (tools/preprocess_data.py)."""
    text = json.dumps({"tokenizer": record, "idx_sha256": _sha256([index_file_path(prefix)])}, indent=1,
                      sort_keys=True)
    write_atomically(sidecar_path(prefix), text + "\n")


def remove_data_tokenizer(prefix: str) -> None:
    """Before PREFIX.bin/.idx are replaced: the old record must not outlive the data it describes."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(sidecar_path(prefix))


def data_tokenizer(prefix: str) -> tuple[dict | None, str | None]:
    """(the tokenizer PREFIX.idx was made with or None when unknown, a note or None). A damaged file is a
    ConfigError naming it."""
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "not valid JSON"
        raise ConfigError(f"{path} is unreadable ({reason}): delete it, or run tools/preprocess_data.py again "
                          f"for {prefix}") from None
    if not (isinstance(found, dict) and _is_record(found.get("tokenizer")) and isinstance(found.get("idx_sha256"),
                                                                                         str)):
        raise ConfigError(f"{path} is damaged (no tokenizer record and .idx sha256): delete it, or run "
                          f"tools/preprocess_data.py again for {prefix}")
    if found["idx_sha256"] != _sha256([index_file_path(prefix)]):
        return None, (f"note: {path} describes another {os.path.basename(index_file_path(prefix))} (the data was "
                      f"made again since): the data's tokenizer is unknown, not checked")
    return found["tokenizer"], None


def check_data_tokenizers(prefixes: list[str], here: dict | None, override: bool) -> tuple[dict, list[str]]:
    """({prefix: the tokenizer it was made with, or None}, notes): data made with another tokenizer than `here`
    is a ConfigError naming both, or a note under --override-tokenizer-check."""
    records, notes = {}, []
    for prefix in prefixes:
        record, note = data_tokenizer(prefix)
        records[prefix] = record
        notes += [note] if note else []
        if record is None or here is None or same_tokenizer(record, here):
            continue
        if not override:
            raise ConfigError(f"--data-path {prefix} was tokenized with {describe(record)}, this run has "
                              f"{describe(here)}: pass the tokenizer it was made with, preprocess it with this "
                              f"run's, or --override-tokenizer-check if this is intended")
        notes.append(f"note: --override-tokenizer-check: {prefix} was tokenized with {describe(record)}, this run "
                     f"has {describe(here)}")
    return records, notes
