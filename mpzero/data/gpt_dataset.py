"""GPT training samples over an indexed dataset, with Megatron-LM's GPTDataset semantics.

Three index arrays define the samples (all built from one `np.random.RandomState(seed)`):
- document index: the split's documents (sequences) repeated for enough epochs, shuffled;
- sample index [num_samples + 1, 2]: (position in the document index, token offset) where sample i
  starts; sample i is the `seq_length + 1` tokens of the concatenated shuffled stream starting at
  token i * seq_length, so consecutive samples share one token (the last input is the next label);
- shuffle index: a permutation of the samples. If the last epoch is needed for fewer than 80% of its
  samples it is shuffled separately, after all earlier epochs, so the partial epoch does not leak
  into the early part of training.

Sample order is a pure function of (data, split, seq_length, seed, num_samples): it never depends on
the number of ranks, and `ds[consumed + k]` after a restart is the sample training would have seen.
"""

from __future__ import annotations

import numpy as np

from mpzero.data.vocab_check import check_sample
from mpzero.errors import ConfigError

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: shuffle a last epoch used below 80% on its own


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens cover num_samples samples of seq_length (+1 shared token)."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Documents repeated num_epochs times and shuffled (the last epoch on its own if separated)."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate((first, build_document_index(documents, 1, rng, False)))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """[n + 1, 2] starts (document-index position, offset) of the n full samples in the token stream.

    Sample i's first token is stream token i * seq_length; n = (tokens - 1) // seq_length so every
    sample has its seq_length + 1 tokens. Worked example: sizes [5, 3, 4], seq_length 4, unshuffled
    -> starts (0, 0), (0, 4), (2, 0).
    """
    doc_sizes = np.asarray(sizes, dtype=np.int64)[document_index]
    ends = np.cumsum(doc_sizes)  # stream position just past each document
    total = int(ends[-1]) if len(ends) else 0
    num_samples = max(total - 1, 0) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right": a start exactly at a document's end belongs to the next non-empty document.
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - doc_sizes[position]) if len(ends) else starts
    dtype = np.int32 if len(document_index) < 2**31 - 1 else np.int64
    sample_index = np.stack([position, offset], axis=1).astype(dtype)
    if len(sample_index):
        sample_index[0] = 0  # Megatron's first start is (0, 0) even before an empty first document
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by a separate one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                      seed: int) -> dict[str, np.ndarray]:
    """The three index arrays for `num_samples` samples over `documents` (ids into `sizes`)."""
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[documents].sum())
    if tokens_per_epoch < 2:
        raise ConfigError(f"a split of {len(documents)} documents holds {tokens_per_epoch} tokens, too few "
                          f"for one sample: give it more data (--split) or request no samples from it")
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = False
    if num_epochs > 1:
        before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - before_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length)
    total = len(sample_index) - 1
    shuffle_index = build_shuffle_index(before_final if separate else total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset:
    """Sample i -> {"tokens": int64[seq_length + 1]}, read through the shuffle and sample indices."""

    def __init__(self, indexed, indices: dict[str, np.ndarray], seq_length: int, *, vocab_size: int | None = None):
        self.indexed, self.seq_length, self.vocab_size = indexed, seq_length, vocab_size
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        j = int(self.shuffle_index[i])
        (first, first_offset), (last, last_offset) = self.sample_index[j], self.sample_index[j + 1]
        doc_ids = self.document_index[first:last + 1]
        if first == last:
            pieces = [self.indexed.get(int(doc_ids[0]), int(first_offset), int(last_offset - first_offset) + 1)]
        else:
            pieces = [self.indexed.get(int(doc_ids[0]), int(first_offset))]
            pieces += [self.indexed.get(int(d)) for d in doc_ids[1:-1]]
            pieces.append(self.indexed.get(int(doc_ids[-1]), 0, int(last_offset) + 1))
        tokens = np.concatenate(pieces).astype(np.int64)
        assert len(tokens) == self.seq_length + 1, "sample index and sizes disagree"
        if self.vocab_size is not None:
            check_sample(tokens, self.vocab_size, f"sample {i} of {self.indexed.path_prefix}")
        return {"tokens": tokens}
