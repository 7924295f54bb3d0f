"""GPT samples: Megatron's sample index on the issue's worked example, and every sample against the
concatenated token stream it must be a window of."""

import numpy as np
import pytest

from mpzero.data import IndexedDatasetBuilder, IndexedDataset, build_gpt_indices, build_sample_index
from mpzero.data.gpt_dataset import GPTDataset, build_document_index, build_shuffle_index, num_epochs_needed
from mpzero.errors import ConfigError


def test_sample_index_matches_issue_worked_example():
    # Documents of 5, 3, 4 tokens, seq_length 4: samples of 5 tokens sharing one token at each seam.
    starts = build_sample_index(np.array([5, 3, 4], np.int32), np.array([0, 1, 2], np.int32), 4)
    assert starts.tolist() == [[0, 0], [0, 4], [2, 0]]


def test_sample_index_matches_stream_positions_with_empty_documents():
    sizes = np.array([3, 0, 7, 1, 0, 4, 9, 2], np.int32)
    doc_index = np.array([2, 0, 1, 7, 4, 5, 3, 6, 2], np.int32)
    starts = build_sample_index(sizes, doc_index, seq_length=3)
    begins = np.concatenate(([0], np.cumsum(sizes[doc_index])[:-1]))
    total = int(sizes[doc_index].sum())
    assert len(starts) - 1 == (total - 1) // 3
    for i, (pos, off) in enumerate(starts.tolist()):
        assert begins[pos] + off == 3 * i and off < sizes[doc_index[pos]]  # start token lies inside its doc


@pytest.fixture
def corpus(tmp_path):
    """40 one-sequence documents of 0..29 tokens; token values encode (document, position) so windows are checkable."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 30, size=40)
    docs = [np.array([1000 * d + t for t in range(n)]) for d, n in enumerate(sizes)]
    with IndexedDatasetBuilder(str(tmp_path / "c"), np.int32) as builder:
        for tokens in docs:
            builder.add_document(tokens, [len(tokens)])  # empty ones become 0-token sequences
    return IndexedDataset(str(tmp_path / "c")), docs


@pytest.mark.parametrize("num_samples, seq_length", [(10, 8), (200, 16), (333, 7)])
def test_gpt_dataset_samples_match_shuffled_stream_windows(corpus, num_samples, seq_length):
    indexed, docs = corpus
    documents = np.arange(5, 35, dtype=np.int32)
    indices = build_gpt_indices(indexed.sequence_lengths, documents, seq_length, num_samples, seed=3)
    ds = GPTDataset(indexed, indices, seq_length)
    assert len(ds) >= num_samples
    stream = np.concatenate([docs[d] for d in indices["document_index"]])  # the reference
    assert sorted(set(indices["document_index"].tolist())) == documents.tolist()
    for i in range(len(ds)):
        j = int(indices["shuffle_index"][i])
        tokens = ds[i]["tokens"]
        assert tokens.dtype == np.int64 and len(tokens) == seq_length + 1
        np.testing.assert_array_equal(tokens, stream[j * seq_length: j * seq_length + seq_length + 1])
    assert sorted(indices["shuffle_index"].tolist()) == list(range(len(ds)))


def test_epochs_and_separate_final_epoch_follow_megatron():
    sizes = np.full(10, 11, np.int32)  # 110 tokens per epoch: (110 - 1) // 10 = 10 samples per epoch
    assert num_epochs_needed(110, 10, 10) == 1 and num_epochs_needed(110, 10, 11) == 2
    # 12 samples: the 2nd epoch supplies 12 - 10 = 2 < int(0.8 * 10) of them -> shuffled on its own.
    small_last = build_gpt_indices(sizes, np.arange(10, dtype=np.int32), 10, 12, seed=0)
    first_epoch = (110 - 1) // 10
    assert sorted(small_last["shuffle_index"][:first_epoch].tolist()) == list(range(first_epoch))
    assert sorted(small_last["document_index"][:10].tolist()) == list(range(10))  # epochs kept apart
    # 19 samples: the last epoch supplies 9 >= 8, so everything is shuffled together.
    full_last = build_gpt_indices(sizes, np.arange(10, dtype=np.int32), 10, 19, seed=0)
    assert sorted(full_last["shuffle_index"][:first_epoch].tolist()) != list(range(first_epoch))


def test_index_builders_are_deterministic_in_the_seed():
    rng_a, rng_b = np.random.RandomState(5), np.random.RandomState(5)
    docs = np.arange(100, dtype=np.int32)
    np.testing.assert_array_equal(build_document_index(docs, 3, rng_a, True), build_document_index(docs, 3, rng_b, True))
    np.testing.assert_array_equal(build_shuffle_index(50, 70, rng_a), build_shuffle_index(50, 70, rng_b))
    a = build_gpt_indices(np.full(100, 9, np.int32), docs, 4, 300, seed=1)["shuffle_index"]
    b = build_gpt_indices(np.full(100, 9, np.int32), docs, 4, 300, seed=2)["shuffle_index"]
    assert not np.array_equal(a, b)


def test_gpt_indices_reject_a_split_without_tokens():
    with pytest.raises(ConfigError, match="too few"):
        build_gpt_indices(np.array([0, 1], np.int32), np.arange(2, dtype=np.int32), 4, 10, seed=0)
