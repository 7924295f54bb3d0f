"""tools/merge_datasets.py: the merge of A and B equals the dataset of A's documents then B's."""

import os
import runpy

import numpy as np

from mpzero.data import IndexedDataset
from tests.test_data_indexed_dataset import write_dataset

merge_main = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "tools", "merge_datasets.py"))["main"]


def test_merge_matches_dataset_written_in_one_go(tmp_path):
    a = [([1, 2, 3], [3]), ([4, 5, 6], [1, 2])]
    b = [([], []), ([7, 8], [2]), ([9], [1])]
    (tmp_path / "parts").mkdir()
    write_dataset(str(tmp_path / "parts" / "a"), a)
    write_dataset(str(tmp_path / "parts" / "b"), b)
    write_dataset(str(tmp_path / "reference"), a + b)
    assert merge_main(["--input", str(tmp_path / "parts" / "a"), str(tmp_path / "parts" / "b.idx"),
                       "--output-prefix", str(tmp_path / "merged")]) == 0
    assert merge_main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "from_dir")]) == 0
    for out in ("merged", "from_dir"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / (out + ext)).read_bytes() == (tmp_path / ("reference" + ext)).read_bytes()
    assert IndexedDataset(str(tmp_path / "merged")).document_indices.tolist() == [0, 1, 3, 3, 4, 5]


def test_merge_reads_a_prefix_beside_its_index_cache_directory(tmp_path):
    # Training's default cache is the directory {prefix}/cache/...: the prefix, not the directory, is meant.
    write_dataset(str(tmp_path / "a"), [([1, 2], [2])])
    (tmp_path / "a" / "cache" / "GPTDataset_indices").mkdir(parents=True)
    assert merge_main(["--input", str(tmp_path / "a"), "--output-prefix", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "a.bin").read_bytes()


def test_merge_refuses_mixed_dtypes_and_leaves_nothing(tmp_path, capsys):
    write_dataset(str(tmp_path / "a"), [([1], [1])], np.uint16)
    write_dataset(str(tmp_path / "b"), [([1], [1])], np.int32)
    assert merge_main(["--input", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert "same tokenizer" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.bin", "b.idx"]
    assert merge_main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.startswith("error: indexed dataset file")
