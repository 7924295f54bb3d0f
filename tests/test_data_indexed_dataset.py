"""The indexed dataset: exact .idx bytes, round trips, and corrupt files caught at open."""

import os
import pickle

import numpy as np
import pytest

from mpzero.data import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from mpzero.errors import ConfigError


def _u64(x):
    return x.to_bytes(8, "little")


def write_dataset(prefix, docs, dtype=np.uint16):
    """docs: list of (tokens, sequence lengths). Also used by the merge tool's tests."""
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for tokens, lengths in docs:
            builder.add_document(np.array(tokens), lengths)
    return prefix


def test_index_bytes_matches_hand_built_megatron_layout(tmp_path):
    # Two documents: [1, 2, 3] as one sequence, then [4, 5] + [6] as two sequences (split sentences).
    prefix = write_dataset(str(tmp_path / "tiny"), [([1, 2, 3], [3]), ([4, 5, 6], [2, 1])])
    expected_idx = (b"MMIDIDX\x00\x00" + _u64(1) + bytes([8]) + _u64(3) + _u64(3)
                    + b"".join(n.to_bytes(4, "little") for n in (3, 2, 1))      # int32 lengths
                    + b"".join(_u64(p) for p in (0, 6, 10))                     # int64 byte pointers
                    + b"".join(_u64(d) for d in (0, 1, 3)))                     # int64 document indices
    assert open(prefix + ".idx", "rb").read() == expected_idx
    assert open(prefix + ".bin", "rb").read() == b"".join(t.to_bytes(2, "little") for t in range(1, 7))
    assert sorted(os.listdir(tmp_path)) == ["tiny.bin", "tiny.idx"]  # no temporary files left


def test_indexed_dataset_round_trip_matches_written_tokens(tmp_path):
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 70000, size=n), [n]) for n in rng.integers(0, 50, size=40)]
    docs.append(([], []))  # an empty document: no sequence, as Megatron writes it
    prefix = write_dataset(str(tmp_path / "rt"), docs, np.int32)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 40 and ds.num_documents == 41
    for i, (tokens, _) in enumerate(docs[:-1]):
        np.testing.assert_array_equal(ds[i], tokens)
    n = len(docs[3][0])
    np.testing.assert_array_equal(ds.get(3, offset=1, length=n - 2), docs[3][0][1:-1])
    assert isinstance(ds[3], np.memmap) and not ds[3].flags.writeable  # a read-only view, not a copy
    assert list(ds.document_indices[-2:]) == [40, 40]
    copy = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 200 and np.array_equal(copy[5], ds[5])  # pickles as its path, not its data


def test_optimal_dtype_switches_at_65500_like_megatron():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32


def test_builder_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "x"), np.uint16) as builder:
            builder.add_document(np.arange(5), [5])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage, message", [
    (lambda p: _truncate(p + ".idx", 1), "truncated or corrupt"),
    (lambda p: _truncate(p + ".idx", 200), "truncated"),
    (lambda p: _truncate(p + ".bin", 2), "truncated or mismatched"),
    (lambda p: _overwrite(p + ".idx", 0, b"XXXXXXX"), "bad magic"),
    (lambda p: _overwrite(p + ".idx", 17, bytes([9])), "dtype code 9"),
    (lambda p: _overwrite(p + ".idx", 34 + 4 * 3 + 8, _u64(7)), "lengths and pointers disagree"),
    (lambda p: os.remove(p + ".bin"), "not found"),
])
def test_indexed_dataset_rejects_damaged_files_at_open(tmp_path, damage, message):
    prefix = write_dataset(str(tmp_path / "d"), [([1, 2, 3], [3]), ([4, 5], [2]), ([6], [1])])
    damage(prefix)
    with pytest.raises(ConfigError, match=message):
        IndexedDataset(prefix)


def test_indexed_dataset_rejects_bad_document_indices(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), [([1, 2, 3], [3]), ([4, 5], [2])])
    _overwrite(prefix + ".idx", os.path.getsize(prefix + ".idx") - 8, _u64(5))  # last entry must be 2
    with pytest.raises(ConfigError, match="document indices"):
        IndexedDataset(prefix)


def _truncate(path, nbytes):
    os.truncate(path, max(os.path.getsize(path) - nbytes, 0))


def _overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
