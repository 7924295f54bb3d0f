"""build_gpt_datasets: splits, blending, the index cache, and one global order whatever the DP size."""

import os
import time

import numpy as np
import pytest

from mpzero.data import IndexedDatasetBuilder, build_gpt_datasets
from mpzero.errors import ConfigError
from tests.distributed import run_ranks


def _make(prefix, num_docs, base, seed):
    """Documents whose tokens are base + document id, so every token tells where it came from."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for d in range(num_docs):
            n = int(rng.integers(1, 40))
            builder.add_document(np.full(n, base + d), [n])
    return prefix


@pytest.fixture
def data(tmp_path):
    return _make(str(tmp_path / "a"), 200, 0, 0), _make(str(tmp_path / "b"), 100, 10_000, 1)


def test_splits_take_disjoint_document_ranges_like_megatron(data, tmp_path):
    train, valid, test = build_gpt_datasets([data[0]], "969,20,11", 8, 1, (50, 10, 5), str(tmp_path / "cache"))
    docs = [set(np.concatenate([ds[i]["tokens"] for i in range(len(ds))]).tolist()) for ds in (train, valid, test)]
    # 200 documents: [0, round(.969 * 200)) = [0, 194), [194, round(.989 * 200)) = [194, 198), [198, 200).
    assert docs[0] <= set(range(194)) and docs[1] <= set(range(194, 198)) and docs[2] <= {198, 199}
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5
    # 969,30,1: test is [round(.999 * 200), 200) = [200, 200), no documents, so no test dataset.
    assert build_gpt_datasets([data[0]], "969,30,1", 8, 1, (50, 10, 5), str(tmp_path / "cache"))[2] is None


def test_empty_splits_are_none(data, tmp_path):
    train, valid, test = build_gpt_datasets([data[0]], "90,10,0", 8, 1, (50, 0, 5), str(tmp_path / "cache"))
    assert train is not None and valid is None and test is None


def test_blend_proportions_match_weights_at_every_prefix(data, tmp_path):
    train, _, _ = build_gpt_datasets(["0.3", data[0], "0.7", data[1]], "100,0,0", 8, 1, (1000, 0, 0),
                                     str(tmp_path / "cache"))
    from_b = np.array([train[i]["tokens"][0] >= 10_000 for i in range(len(train))])
    assert len(train) >= 1000
    for n in range(1, len(train) + 1):  # Megatron's greedy order: within one sample of the target share
        assert abs(from_b[:n].sum() - 0.7 * n) <= 1.0
    assert all((train[i]["tokens"] >= 10_000).all() == from_b[i] for i in range(0, 1000, 37))


def test_index_cache_is_reused_and_keyed_by_settings(data, tmp_path):
    cache = str(tmp_path / "cache")
    first = build_gpt_datasets([data[0]], "100,0,0", 8, 1, (100, 0, 0), cache)[0]
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    mtimes = [os.path.getmtime(os.path.join(cache, f)) for f in files]
    again = build_gpt_datasets([data[0]], "100,0,0", 8, 1, (100, 0, 0), cache)[0]
    assert [os.path.getmtime(os.path.join(cache, f)) for f in files] == mtimes  # loaded, not rebuilt
    consumed = 37  # a resumed run asks for sample consumed + k and must get what the first run would have
    for k in range(20):
        np.testing.assert_array_equal(again[consumed + k]["tokens"], first[consumed + k]["tokens"])
    build_gpt_datasets([data[0]], "100,0,0", 16, 1, (100, 0, 0), cache)
    assert len(os.listdir(cache)) == 8  # another seq_length: its own files


def test_default_cache_lives_beside_the_data(data):
    build_gpt_datasets([data[0]], "100,0,0", 8, 1, (10, 0, 0))
    assert len(os.listdir(os.path.join(data[0], "cache", "GPTDataset_indices"))) == 4


def _global_order(data, cache, n):
    from mpzero.parallel import init_parallel

    groups = init_parallel(tp_size=1, timeout_minutes=1)
    train, valid, _ = build_gpt_datasets(["0.5", data[0], "0.5", data[1]], "90,10,0", 8, 7, (n, 20, 0), cache, groups)
    return groups.dp_size, [train[i]["tokens"].tolist() for i in range(n)], [valid[i]["tokens"].tolist() for i in range(20)]


def test_global_order_matches_between_dp1_and_dp4(data, tmp_path):
    one = run_ranks(1, _global_order, data, str(tmp_path / "c1"), 120)
    four = run_ranks(4, _global_order, data, str(tmp_path / "c4"), 120)  # a fresh cache: rank 0 builds it
    assert one[0][0] == 1 and [r[0] for r in four] == [4] * 4
    for rank_result in four:
        assert rank_result[1:] == one[0][1:]


def _load_or_build_logging_builders(cache, log):
    from mpzero.data.index_cache import load_or_build
    from mpzero.parallel import init_parallel

    groups = init_parallel(1, timeout_minutes=1)

    def build():
        time.sleep(0.2)  # so that any rank that wrongly built too would start before rank 0 finished
        with open(log, "a") as f:
            f.write(f"rank {groups.world.rank}\n")
        return {"a": np.arange(5)}
    return load_or_build(cache, "T", {"k": 1}, build, ("a",), groups)["a"].tolist()


def test_index_cache_is_built_by_rank_0_alone_and_read_by_all(tmp_path):
    log = tmp_path / "builds.log"
    assert run_ranks(4, _load_or_build_logging_builders, str(tmp_path / "c"), str(log)) == [list(range(5))] * 4
    assert log.read_text() == "rank 0\n"


def _build_into_bad_cache(data, cache):
    from mpzero.parallel import init_parallel

    try:
        build_gpt_datasets([data[0]], "100,0,0", 8, 1, (10, 0, 0), cache, init_parallel(1, timeout_minutes=1))
    except ConfigError as exc:
        return str(exc)
    return None


def test_failed_build_raises_on_every_rank_without_hanging(data, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    messages = run_ranks(2, _build_into_bad_cache, data, str(not_a_dir / "cache"), deadline=60)
    assert all(m and "index cache" in m for m in messages)


def test_bad_arguments_are_config_errors(data):
    with pytest.raises(ConfigError, match="weight/prefix pairs"):
        build_gpt_datasets(["0.5", data[0], data[1]], "1", 8, 1, (1, 0, 0))
    with pytest.raises(ConfigError, match="not found"):
        build_gpt_datasets([data[0] + "_missing"], "1", 8, 1, (1, 0, 0))
    with pytest.raises(ConfigError, match="--split"):
        build_gpt_datasets([data[0]], "a,b", 8, 1, (1, 0, 0))


def test_rewritten_dataset_of_same_sizes_gets_new_indices(tmp_path):
    """Re-preprocessing into the same prefix (same sequence count and .bin size, another document order)
    must not reuse the old sample index: the cache is keyed by the .idx contents."""
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    sizes = [3, 17, 5, 29, 11, 2, 23, 7] * 5

    def write(order):
        with IndexedDatasetBuilder(prefix, np.int32) as builder:
            for d in order:
                builder.add_document(np.full(sizes[d], d), [sizes[d]])

    def samples(cache_dir):
        train = build_gpt_datasets([prefix], "1", 8, 1, (30, 0, 0), cache_dir)[0]
        return [train[i]["tokens"].tolist() for i in range(len(train))]

    write(range(len(sizes)))
    samples(cache)
    write(reversed(range(len(sizes))))  # same count, same .bin size, other lengths per position
    assert samples(cache) == samples(str(tmp_path / "fresh"))


@pytest.mark.parametrize("order", ["zero first", "zero last"])
def test_zero_weight_takes_no_samples_wherever_it_stands(data, tmp_path, order):
    a, b = data
    path = ["0", a, "1", b] if order == "zero first" else ["1", b, "0", a]
    train = build_gpt_datasets(path, "100,0,0", 8, 1, (200, 0, 0), str(tmp_path / "cache"))[0]
    alone = build_gpt_datasets([b], "100,0,0", 8, 1, (200, 0, 0), str(tmp_path / "cache"))[0]
    assert len(train) >= 200
    for i in range(200):  # the weight-0 dataset is dropped: the run is B's alone
        np.testing.assert_array_equal(train[i]["tokens"], alone[i]["tokens"])


def test_blending_never_picks_a_zero_weight():
    from mpzero.data import build_blending_indices

    for weights in ([0.0, 1.0], [0.0, 0.5, 0.0, 0.5]):
        indices = build_blending_indices(weights, 100)["dataset_index"]
        assert all(weights[d] > 0 for d in indices.tolist())


def test_train_split_without_documents_is_one_line_at_start(data, tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"--split 0,1,0 gives the train split of .*/a no documents"):
        build_gpt_datasets([data[0]], "0,1,0", 8, 1, (50, 10, 0), cache)
    # 200 documents, 1/1000 of them: the train share rounds to none.
    with pytest.raises(ConfigError, match=r"--split 1,999,0 gives the train split of .*/a no documents"):
        build_gpt_datasets([data[0]], "1,999,0", 8, 1, (50, 10, 0), cache)
    # In a blend too: 1/200 of A's 200 documents is one, of B's 100 it rounds to none.
    with pytest.raises(ConfigError, match=r"--split 1,199,0 gives the train split of .*/b no documents"):
        build_gpt_datasets(["1", data[0], "1", data[1]], "1,199,0", 8, 1, (50, 10, 0), cache)
    empty = str(tmp_path / "empty")
    with IndexedDatasetBuilder(empty, np.uint16):
        pass  # what an empty JSONL preprocesses to: 0 documents
    with pytest.raises(ConfigError, match=r".*/empty holds no documents, so its train split has none"):
        build_gpt_datasets([empty], "969,30,1", 8, 1, (50, 10, 10), cache)
    # Only the splits the run asks samples of matter: no training samples, no complaint.
    assert build_gpt_datasets([data[0]], "0,1,0", 8, 1, (0, 10, 0), cache)[0] is None


def test_train_split_without_tokens_names_the_dataset(tmp_path):
    prefix = str(tmp_path / "blank")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(5):
            builder.add_document(np.zeros(0, np.uint16), [0])
    with pytest.raises(ConfigError, match=r"train split of .*/blank \(documents \[0, 5\) of --split 1\) holds 0 tok"):
        build_gpt_datasets([prefix], "1", 8, 1, (10, 0, 0), str(tmp_path / "cache"))
