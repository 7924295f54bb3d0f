"""Token ids beyond the run's vocabulary stop the run at dataset open, naming dataset, largest id and
vocabulary size; the scan is cached, and every sample read is checked too."""

import json
import os
import runpy

import numpy as np
import pytest

from mpzero.data import IndexedDataset, IndexedDatasetBuilder, build_gpt_datasets, build_gpt_indices
from mpzero.data.gpt_dataset import GPTDataset
from mpzero.errors import ConfigError

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
preprocess_main = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]


@pytest.fixture
def big_vocab_data(tmp_path):
    """A real preprocessed dataset made with a 1000-id NullTokenizer: ids up to 999, EOD 1000."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=rng.integers(5, 40)).tolist() for _ in range(50)]
    docs[17][3] = 999
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    out = str(tmp_path / "big")
    assert preprocess_main(["--input", str(inp), "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "1000", "--append-eod", "--no-progress"]) == 0
    return out + "_text_document"


def test_ids_beyond_the_vocabulary_fail_at_open_naming_dataset_id_and_size(big_vocab_data, tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(ConfigError, match=rf"^{big_vocab_data} holds token ids up to 1000 but the vocabulary "
                                          rf"has 500 ids \(0\.\.499\): "):
        build_gpt_datasets([big_vocab_data], "1", 8, 1, (10, 0, 0), cache, vocab_size=500)
    with pytest.raises(ConfigError, match="up to 1000 but the vocabulary has 1000 ids"):  # EOD is id 1000
        build_gpt_datasets(["1", big_vocab_data], "1", 8, 1, (10, 0, 0), cache, vocab_size=1000)
    train = build_gpt_datasets([big_vocab_data], "1", 8, 1, (10, 0, 0), cache, vocab_size=1001)[0]
    assert len(train) >= 10
    # None (the default) checks nothing: today's behaviour for callers that do not know the vocabulary.
    assert build_gpt_datasets([big_vocab_data], "1", 8, 1, (10, 0, 0), cache)[0] is not None


def test_scan_is_cached_by_index_digest_and_bin_file(big_vocab_data, tmp_path):
    cache = tmp_path / "cache"
    build_gpt_datasets([big_vocab_data], "1", 8, 1, (10, 0, 0), str(cache), vocab_size=1001)
    scans = sorted(f for f in os.listdir(cache) if "TokenRange" in f)
    assert len(scans) == 2  # the range array and its description
    stamp = [os.path.getmtime(cache / f) for f in scans]
    build_gpt_datasets([big_vocab_data], "1", 8, 1, (20, 0, 0), str(cache), vocab_size=1001)
    assert sorted(f for f in os.listdir(cache) if "TokenRange" in f) == scans  # read, not rescanned
    assert [os.path.getmtime(cache / f) for f in scans] == stamp
    assert np.load(cache / [f for f in scans if f.endswith(".npy")][0]).tolist() == [0, 1000]


def test_every_sample_read_is_checked_against_the_vocabulary(tmp_path):
    """The backstop behind the cached scan: a sample holding an id >= vocab_size raises, naming it."""
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for d in range(20):
            builder.add_document(np.arange(10, dtype=np.uint16) + (700 if d == 7 else 0), [10])
    indexed = IndexedDataset(prefix)
    indices = build_gpt_indices(indexed.sequence_lengths, np.arange(20, dtype=np.int32), 4, 40, seed=0)
    ds = GPTDataset(indexed, indices, 4, vocab_size=600)
    bad = [i for i in range(len(ds)) if GPTDataset(indexed, indices, 4)[i]["tokens"].max() >= 600]
    assert bad and bad != list(range(len(ds)))
    with pytest.raises(ConfigError, match=rf"sample {bad[0]} of {prefix} holds token id 70\d "
                                          rf"but the vocabulary has 600 ids"):
        ds[bad[0]]
    good = next(i for i in range(len(ds)) if i not in bad)
    assert ds[good]["tokens"].max() < 600


def _open_with_small_vocab(prefix, cache):
    from mpzero.parallel import init_parallel

    try:
        build_gpt_datasets([prefix], "1", 8, 1, (10, 0, 0), cache, init_parallel(1, timeout_minutes=1),
                           vocab_size=500)
    except ConfigError as exc:
        return str(exc)
    return None


def test_every_rank_hears_of_ids_beyond_the_vocabulary(big_vocab_data, tmp_path):
    from tests.distributed import run_ranks

    messages = run_ranks(2, _open_with_small_vocab, big_vocab_data, str(tmp_path / "cache"), deadline=60)
    assert all(m and m.startswith(f"{big_vocab_data} holds token ids up to 1000") for m in messages)
