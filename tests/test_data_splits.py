"""--split and --data-path parsing, against the fractions and ranges Megatron-LM computes."""

import pytest

from mpzero.data import parse_data_path, parse_split
from mpzero.data.splits import split_document_range
from mpzero.errors import ConfigError


def test_parse_split_matches_megatron_bookends():
    # Megatron normalises the weights, then accumulates them: the same float operations, so exact.
    a, b, c = 969 / 1000, 30 / 1000, 1 / 1000
    assert parse_split("969,30,1") == [(0, a), (a, a + b), (a + b, a + b + c)]
    assert parse_split("98,2") == [(0, 98 / 100), (98 / 100, 98 / 100 + 2 / 100), None]
    assert parse_split("1") == [(0, 1.0), None, None]
    assert parse_split("0,1,0") == [None, (0, 1.0), None]


def test_split_document_ranges_are_contiguous_and_cover_everything():
    for split in ("969,30,1", "7,2,1", "1,1,1", "90,10,0"):
        ranges = [split_document_range(b, 1000) for b in parse_split(split) if b is not None]
        assert ranges[0][0] == 0 and ranges[-1][1] == 1000
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert split_document_range(parse_split("969,30,1")[1], 1000) == (969, 999)


@pytest.mark.parametrize("bad", ["", "a,b", "1,2,3,4", "-1,2", "0,0,0"])
def test_parse_split_rejects_bad_strings(bad):
    with pytest.raises(ConfigError, match="--split"):
        parse_split(bad)


def test_parse_data_path_forms():
    assert parse_data_path(["A"]) == (["A"], [1.0])
    prefixes, weights = parse_data_path(["30", "A", "70", "B"])
    assert prefixes == ["A", "B"] and weights == pytest.approx([0.3, 0.7])


@pytest.mark.parametrize("bad, message", [([], "empty"), (["A", "B"], "number"), (["1", "A", "B"], "pairs"),
                                          (["0", "A", "0", "B"], "positive sum")])
def test_parse_data_path_rejects_bad_lists(bad, message):
    with pytest.raises(ConfigError, match=message):
        parse_data_path(bad)


def test_parse_data_path_drops_zero_weights():
    assert parse_data_path(["0", "A", "1", "B"]) == (["B"], [1.0])
    assert parse_data_path(["1", "B", "0", "A"]) == (["B"], [1.0])
    prefixes, weights = parse_data_path(["1", "A", "0", "B", "3", "C"])
    assert prefixes == ["A", "C"] and weights == pytest.approx([0.25, 0.75])
