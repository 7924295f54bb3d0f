"""Token ids against the run's vocabulary: a dataset tokenized with a larger vocabulary must stop the run.

Such ids train silently under tensor parallelism (they fall outside every rank's embedding shard and meet
zeros) and die with an IndexError without it. The .idx does not store the vocabulary, so the ids are read:

- At open (`check_vocabulary`, called by `build_gpt_datasets(..., vocab_size=V)`): the smallest and largest
  id of the whole .bin, found once by a chunked scan of the memory-mapped tokens (bounded memory, about
  the speed of reading the file) and cached as a 2-element .npy keyed by the .idx's sha256 (every length
  and pointer) and the .bin's size and modification time. Later runs read the cached pair and pay nothing;
  a re-preprocessed dataset has a new .idx or a new .bin mtime, so it is scanned again. Rank 0 of the group
  scans (or reads the cache) and passes the pair to the others, so only rank 0 needs the cache directory.
- At every sample (`GPTDataset(..., vocab_size=V)`): the sample's max and min, a few microseconds beside
  a training step. It is the backstop for what the cache key cannot see (a .bin rewritten with the same
  lengths and its mtime restored) and names the sample.
"""

from __future__ import annotations

import os

import numpy as np

from mpzero.data.index_cache import load_or_build
from mpzero.data.indexed_dataset import IndexedDataset, data_file_path
from mpzero.errors import ConfigError

_SCAN_CHUNK = 1 << 24  # tokens per np.min/np.max pass


def scan_token_range(indexed: IndexedDataset) -> np.ndarray:
    """[smallest id, largest id] of every token in the .bin ([] if it holds none), chunk by chunk."""
    tokens = indexed._tokens
    lo, hi = None, None
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        lo = chunk.min() if lo is None else min(lo, chunk.min())
        hi = chunk.max() if hi is None else max(hi, chunk.max())
    dtype = np.float64 if np.issubdtype(indexed.dtype, np.floating) else np.int64
    return np.array([] if lo is None else [lo, hi], dtype=dtype)


def token_id_range(indexed: IndexedDataset, cache_dir: str | None, group=None) -> tuple | None:
    """(smallest id, largest id) of the dataset, None if it holds no tokens; scanned once, then cached."""
    group = getattr(group, "world", group)  # ParallelGroups -> its world CommGroup
    result, error, failure = None, None, None
    if group is None or group.rank == 0:
        bin_stat = os.stat(data_file_path(indexed.path_prefix))
        description = {"class": "TokenRange", "path_prefix": os.path.abspath(indexed.path_prefix),
                       "idx_sha256": indexed.index_digest, "bin_bytes": bin_stat.st_size,
                       "bin_mtime_ns": bin_stat.st_mtime_ns}
        cache = cache_dir or os.path.join(indexed.path_prefix, "cache", "TokenRange")
        try:
            pair = load_or_build(cache, "TokenRange", description, lambda: {"range": scan_token_range(indexed)},
                                 ("range",))["range"]
            result = tuple(v.item() for v in pair) or None
        except ConfigError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, not wait
            error, failure = f"reading the token ids of {indexed.path_prefix} failed: {exc}", exc
    if group is not None:
        result, error = group.all_gather_objects((result, error))[0]
    if failure is not None:
        raise failure
    if error:
        raise ConfigError(error)
    return result


def check_vocabulary(indexed: IndexedDataset, vocab_size: int, cache_dir: str | None, group=None) -> None:
    """ConfigError naming the dataset, its largest (or a negative) id and the vocabulary size if any id
    lies outside [0, vocab_size)."""
    found = token_id_range(indexed, cache_dir, group)
    if found is None:
        return
    lo, hi = found
    if hi >= vocab_size:
        raise ConfigError(f"{indexed.path_prefix} holds token ids up to {_show(hi)} but the vocabulary has "
                          f"{vocab_size} ids (0..{vocab_size - 1}): preprocess it with this run's tokenizer, "
                          f"or train with the tokenizer (--vocab-size) it was made with")
    if lo < 0:
        raise ConfigError(f"{indexed.path_prefix} holds a negative token id {_show(lo)}: it is not a tokenized "
                          f"dataset of this vocabulary; re-run tools/preprocess_data.py")


def check_sample(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """The per-sample backstop: `where` names the sample ("sample 12 of data/x")."""
    hi, lo = tokens.max(), tokens.min()
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise ConfigError(f"{where} holds token id {_show(bad)} but the vocabulary has {vocab_size} ids "
                          f"(0..{vocab_size - 1}): the dataset was made with another tokenizer; preprocess it "
                          f"with this run's")


def _show(value) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
