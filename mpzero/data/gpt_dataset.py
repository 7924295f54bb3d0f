"""GPT training samples over an indexed dataset: Megatron-LM's GPTDataset windows, epoch-by-epoch order.

Three index arrays define the samples:
- document index: the split's documents (sequences), one shuffled copy per epoch, epoch after epoch;
- sample index [num_samples + 1, 2]: (position in the document index, token offset) where sample i
  starts; sample i is the `seq_length + 1` tokens of the concatenated shuffled stream starting at
  token i * seq_length, so consecutive samples share one token (the last input is the next label);
- shuffle index: a permutation of the samples, block by block: block k is samples [k * P, (k + 1) * P),
  P = samples per block (below), shuffled among themselves.

The order of the first n samples does not depend on how many are asked for: asking for more only appends
epochs and blocks. So a run resumed with a larger --train-iters continues at `consumed samples` in the
order it started with, instead of a new permutation. This is how:
- the epochs of the document index are shuffled one after another by one `RandomState([seed, 0])`, and
  the blocks of the shuffle index one after another by another, `RandomState([seed, 1])`: epoch e's and
  block k's shuffles draw the same numbers whatever follows them;
- a block is B epochs' worth of samples, B = the fewest epochs holding one sample (1 unless an epoch has
  fewer than seq_length + 1 tokens), P = (B * tokens_per_epoch - 1) // seq_length; enough whole blocks
  are built to cover num_samples (len(dataset) is that multiple of P, up to P - 1 more than asked), and K
  blocks need K * B epochs of documents. Blocks drift against epochs by at most one sample per block.

Megatron shuffles all samples of all epochs together except a last epoch used for under 80% of its
samples, which it shuffles on its own after the others (so that a partial epoch's samples are not spread
through training). Both choices depend on num_samples, which is what made a longer run reshuffle, so
they are gone: shuffling each block on its own keeps every epoch, the last one included, after the ones
before it, which is what the separate-last-epoch rule was for, and costs the early-training mixing of
samples across epochs that nobody relies on. Windows are byte-for-byte Megatron's given the same document
index; the permutations are not.

Sample order is a pure function of (data, split, seq_length, seed, and for n samples nothing else): it
never depends on the number of ranks, and `ds[consumed + k]` after a restart is the sample training
would have seen.
"""

from __future__ import annotations

import numpy as np

from mpzero.data.vocab_check import check_sample
from mpzero.errors import ConfigError


def block_plan(tokens_per_epoch: int, seq_length: int, num_samples: int) -> tuple[int, int, int]:
    """(epochs per block B, samples per block P, blocks K) covering num_samples; K * B epochs are needed."""
    epochs_per_block = max(1, -(-(seq_length + 1) // tokens_per_epoch))
    per_block = (epochs_per_block * tokens_per_epoch - 1) // seq_length
    return epochs_per_block, per_block, max(1, -(-num_samples // per_block))


def build_document_index(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """The documents, shuffled once per epoch, epochs back to back; epoch e is the same for any num_epochs."""
    documents = np.asarray(documents, dtype=np.int32)
    rng = np.random.RandomState([seed, 0])
    index = np.empty(num_epochs * len(documents), dtype=np.int32)
    for e in range(num_epochs):
        epoch = index[e * len(documents):(e + 1) * len(documents)]
        epoch[:] = documents
        rng.shuffle(epoch)
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


def build_shuffle_index(per_block: int, num_blocks: int, seed: int) -> np.ndarray:
    """Block k (samples [k * per_block, (k + 1) * per_block)) permuted among itself, blocks in order;
    block k is the same for any num_blocks."""
    total = per_block * num_blocks
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    index = np.arange(total, dtype=dtype)
    rng = np.random.RandomState([seed, 1])
    for k in range(num_blocks):
        rng.shuffle(index[k * per_block:(k + 1) * per_block])
    return index


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                      seed: int) -> dict[str, np.ndarray]:
    """The three index arrays for at least `num_samples` samples over `documents` (ids into `sizes`)."""
    if not 0 <= seed < 2**32:
        raise ConfigError(f"--seed {seed} is outside [0, 2**32), the range numpy's RandomState takes: "
                          f"choose a seed in it")
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[documents].sum())
    if tokens_per_epoch < 2:
        raise ConfigError(f"a split of {len(documents)} documents holds {tokens_per_epoch} tokens, too few "
                          f"for one sample: give it more data (--split) or request no samples from it")
    epochs_per_block, per_block, num_blocks = block_plan(tokens_per_epoch, seq_length, num_samples)
    document_index = build_document_index(documents, epochs_per_block * num_blocks, seed)
    # K * B epochs hold (K * B * T - 1) // s >= K * P samples: keep exactly the K whole blocks.
    sample_index = build_sample_index(sizes, document_index, seq_length)[:per_block * num_blocks + 1]
    shuffle_index = build_shuffle_index(per_block, num_blocks, seed)
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
