"""GPT samples: Megatron's sample index on the issue's worked example, every sample against the
concatenated token stream it must be a window of, and the epoch-by-epoch order that asking for more
samples only extends."""

import numpy as np
import pytest

from mpzero.data import IndexedDatasetBuilder, IndexedDataset, build_gpt_indices, build_sample_index
from mpzero.data.gpt_dataset import GPTDataset, block_plan, build_document_index, build_shuffle_index
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


def test_every_epoch_covers_every_document_once_and_blocks_shuffle_among_themselves():
    sizes = np.full(10, 11, np.int32)  # 110 tokens per epoch: (110 - 1) // 10 = 10 samples per block
    assert block_plan(110, 10, 10) == (1, 10, 1) and block_plan(110, 10, 11) == (1, 10, 2)
    assert block_plan(5, 10, 3) == (3, 1, 3)  # 5-token epochs: a sample of 11 tokens needs 3 of them
    indices = build_gpt_indices(sizes, np.arange(10, dtype=np.int32), 10, 25, seed=0)
    document_index, shuffle_index = indices["document_index"], indices["shuffle_index"]
    assert len(document_index) == 30 and len(shuffle_index) == 30 == len(indices["sample_index"]) - 1
    for e in range(3):
        assert sorted(document_index[10 * e:10 * (e + 1)].tolist()) == list(range(10))  # each doc once per epoch
        block = shuffle_index[10 * e:10 * (e + 1)].tolist()
        assert sorted(block) == list(range(10 * e, 10 * (e + 1))) and block != sorted(block)
    assert document_index[:10].tolist() != document_index[10:20].tolist()  # each epoch its own shuffle


def test_index_builders_are_deterministic_in_the_seed():
    docs = np.arange(100, dtype=np.int32)
    np.testing.assert_array_equal(build_document_index(docs, 3, 5), build_document_index(docs, 3, 5))
    np.testing.assert_array_equal(build_document_index(docs, 3, 5), build_document_index(docs, 5, 5)[:300])
    np.testing.assert_array_equal(build_shuffle_index(50, 2, 5), build_shuffle_index(50, 2, 5))
    np.testing.assert_array_equal(build_shuffle_index(50, 2, 5), build_shuffle_index(50, 4, 5)[:100])
    a = build_gpt_indices(np.full(100, 9, np.int32), docs, 4, 300, seed=1)["shuffle_index"]
    b = build_gpt_indices(np.full(100, 9, np.int32), docs, 4, 300, seed=2)["shuffle_index"]
    assert not np.array_equal(a, b)
    with pytest.raises(ConfigError, match=r"--seed -1 is outside \[0, 2\*\*32\)"):
        build_gpt_indices(np.full(100, 9, np.int32), docs, 4, 300, seed=-1)


def test_gpt_indices_reject_a_split_without_tokens():
    with pytest.raises(ConfigError, match="too few"):
        build_gpt_indices(np.array([0, 1], np.int32), np.arange(2, dtype=np.int32), 4, 10, seed=0)


@pytest.mark.parametrize("seq_length", [7, 16, 64])  # 64: a sample needs more than one epoch's tokens
def test_asking_for_more_samples_only_appends(corpus, seq_length):
    """Training longer (a larger --train-iters on resume) must not reshuffle what is left: the first n
    samples are the same whether n or 3n are asked for, over a dataset of several epochs."""
    indexed, _ = corpus
    documents = np.arange(0, 12, dtype=np.int32)  # a few hundred tokens: n samples span several epochs
    tokens_per_epoch = int(indexed.sequence_lengths[documents].astype(np.int64).sum())
    n = 4 * tokens_per_epoch // seq_length + 3
    short = GPTDataset(indexed, build_gpt_indices(indexed.sequence_lengths, documents, seq_length, n, seed=3),
                       seq_length)
    long = GPTDataset(indexed, build_gpt_indices(indexed.sequence_lengths, documents, seq_length, 3 * n, seed=3),
                      seq_length)
    assert len(short) >= n and len(long) >= 3 * n
    for i in range(n):
        np.testing.assert_array_equal(short[i]["tokens"], long[i]["tokens"])


def test_resumed_run_with_more_iterations_reads_the_same_samples(tmp_path):
    from mpzero.data import build_gpt_datasets

    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for d in range(30):
            builder.add_document(np.arange(d % 7 + 3) + 100 * d, [d % 7 + 3])
    first = build_gpt_datasets([prefix], "1", 8, 5, (100, 0, 0))[0]  # ~180 tokens per epoch: 5 epochs
    longer = build_gpt_datasets([prefix], "1", 8, 5, (400, 0, 0))[0]
    for i in range(100):
        np.testing.assert_array_equal(first[i]["tokens"], longer[i]["tokens"])
