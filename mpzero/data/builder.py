"""`build_gpt_datasets`: the one call `pretrain_gpt.py` makes to get train/valid/test datasets.

    train, valid, test = build_gpt_datasets(["0.3", "A", "0.7", "B"], "969,30,1", seq_length=1024,
                                            seed=1234, num_samples=(n_train, n_valid, n_test),
                                            cache_dir=None, group=groups, vocab_size=tokenizer.vocab_size)
    train[i]["tokens"]  # int64[seq_length + 1], sample i of a fixed global order

Each split of each prefix is a `GPTDataset`; with several prefixes each split is a `BlendedDataset`
whose parts are built for their share of the samples plus 0.5% (Megatron's margin), so the blend
never runs a part dry. Index arrays are cached in `cache_dir`, or by default in
`{prefix}/cache/GPTDataset_indices/` as Megatron does; blends go to `cache_dir` or the first prefix's.
"""

from __future__ import annotations

import math
import os

import numpy as np

from mpzero.data.blended_dataset import BlendedDataset, build_blending_indices
from mpzero.data.gpt_dataset import GPTDataset, build_gpt_indices
from mpzero.data.index_cache import load_or_build
from mpzero.data.indexed_dataset import IndexedDataset
from mpzero.data.splits import SPLIT_NAMES, parse_data_path, parse_split, split_document_range
from mpzero.data.vocab_check import check_vocabulary
from mpzero.errors import ConfigError

_BLEND_SURPLUS = 0.005  # Megatron's extra share per part so rounding never exhausts one


def build_gpt_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], cache_dir: str | None = None, group=None, *,
                       vocab_size: int | None = None) -> list:
    """[train, valid, test]: each a dataset of at least num_samples[k] samples, or None if no samples
    were asked of it or (valid, test) it has no documents. A train split asked for samples that has no
    documents is a ConfigError naming the dataset and --split, raised here before any index is built.

    `group`: None, a CommGroup or ParallelGroups; its rank 0 builds missing index caches while the others
    wait, then everyone loads them, so every rank of the group must make this call (with the same arguments).

    `vocab_size`: the run's vocabulary (the tokenizer's, before padding). Given, every dataset's token ids
    are checked against it at open (a cached whole-file scan, `vocab_check`) and again in every sample
    read; an id outside [0, vocab_size) is a ConfigError naming the dataset, the id and the size. None
    checks nothing."""
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"vocab_size {vocab_size}: need at least 1 (or None to skip the token-id check)")
    if seq_length < 1 or len(num_samples) != 3 or min(num_samples) < 0:
        raise ConfigError(f"need seq_length >= 1 and three non-negative sample counts, got {seq_length}, "
                          f"{num_samples}")
    prefixes, weights = parse_data_path(data_path)
    bounds = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    if num_samples[0] > 0:  # training reads its split from the first step: it must have data, said now
        for ds in indexed:
            _check_train_split(ds, bounds[0], split)
    if vocab_size is not None:
        for ds in indexed:
            check_vocabulary(ds, vocab_size, cache_dir, group)
    out = []
    for k, name in enumerate(SPLIT_NAMES):
        if bounds[k] is None or num_samples[k] == 0:
            out.append(None)  # no share in --split, or nothing asked of it
        elif len(prefixes) == 1:
            out.append(_gpt_split(indexed[0], bounds[k], name, seq_length, seed, num_samples[k], cache_dir, group,
                                  vocab_size))
        else:
            out.append(_blended_split(indexed, weights, bounds[k], name, seq_length, seed, num_samples[k],
                                      cache_dir, group, vocab_size))
    return out


def _check_train_split(indexed: IndexedDataset, bounds, split: str) -> None:
    """One line naming the dataset and the cause if the train split has no documents or no sample's worth
    of tokens (valid/test may be empty: evaluation is then skipped, as in Megatron)."""
    prefix = indexed.path_prefix
    if len(indexed) == 0:
        raise ConfigError(f"{prefix} holds no documents, so its train split has none: preprocess a non-empty "
                          f"input into it (tools/preprocess_data.py reported 0 documents) or drop it from --data-path")
    begin, end = split_document_range(bounds, len(indexed)) if bounds is not None else (0, 0)
    if begin == end:
        raise ConfigError(f"--split {split} gives the train split of {prefix} no documents (its share of the "
                          f"{len(indexed)} documents rounds to none): give train a larger share, e.g. --split 969,30,1")
    tokens = int(np.asarray(indexed.sequence_lengths[begin:end], dtype=np.int64).sum())
    if tokens < 2:
        raise ConfigError(f"the train split of {prefix} (documents [{begin}, {end}) of --split {split}) holds "
                          f"{tokens} tokens, too few for one sample: give it more data or a larger share")


def _gpt_split(indexed: IndexedDataset, bounds, name: str, seq_length: int, seed: int, num_samples: int,
               cache_dir: str | None, group, vocab_size: int | None = None) -> GPTDataset | None:
    begin, end = split_document_range(bounds, len(indexed))
    if begin == end:
        return None  # a small share of few documents can round to none
    # The indices are a function of the sequence lengths (all in the .idx), the split's documents, seq_length,
    # seed and num_samples: the key holds exactly these. The path is only there for the reader of the file.
    description = {"class": "GPTDataset", "path_prefix": os.path.abspath(indexed.path_prefix),
                   "idx_sha256": indexed.index_digest, "split": name, "documents": [begin, end],
                   "seq_length": seq_length, "seed": seed, "num_samples": num_samples}
    cache = cache_dir or os.path.join(indexed.path_prefix, "cache", "GPTDataset_indices")

    def build():
        return build_gpt_indices(indexed.sequence_lengths, np.arange(begin, end, dtype=np.int32),
                                 seq_length, num_samples, seed)

    indices = load_or_build(cache, f"GPTDataset-{name}", description, build,
                            ("document_index", "sample_index", "shuffle_index"), group)
    return GPTDataset(indexed, indices, seq_length, vocab_size=vocab_size)


def _blended_split(indexed: list[IndexedDataset], weights: list[float], bounds, name: str, seq_length: int,
                   seed: int, num_samples: int, cache_dir: str | None, group,
                   vocab_size: int | None = None) -> BlendedDataset:
    targets = [math.ceil(num_samples * w) for w in weights]
    parts = [_gpt_split(ds, bounds, name, seq_length, seed, math.ceil(t * (1 + _BLEND_SURPLUS)), cache_dir, group,
                        vocab_size) if t else None for ds, t in zip(indexed, targets)]
    if all(part is None for part in parts):
        return None
    size = sum(targets)
    description = {"class": "BlendedDataset", "datasets": [os.path.abspath(d.path_prefix) for d in indexed],
                   "weights": weights, "split": name, "size": size, "seq_length": seq_length, "seed": seed}
    cache = cache_dir or os.path.join(indexed[0].path_prefix, "cache", "BlendedDataset_indices")
    indices = load_or_build(cache, f"BlendedDataset-{name}", description,
                            lambda: build_blending_indices(weights, size),
                            ("dataset_index", "dataset_sample_index"), group)
    for d, (part, target) in enumerate(zip(parts, targets)):
        # The greedy order never takes more than ceil(size * weight) from a part; check, don't trust.
        taken = int((indices["dataset_index"] == d).sum())
        if taken and part is None:
            raise ConfigError(f"the {name} split of {indexed[d].path_prefix} has no documents but its blend "
                              f"weight asks for {taken} samples: change --split or the weights")
        if taken > len(part or ()):
            raise ConfigError(f"blend needs {taken} samples of {indexed[d].path_prefix} but it has {len(part)}: "
                              f"the blending index cache is inconsistent; delete {cache}")
    return BlendedDataset(parts, indices)
