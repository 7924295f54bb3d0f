"""The load-balanced split of a sequence over CP ranks (`mpzero.context_parallel.chunks`) against the assignment
written out here (Megatron's docstring example: CP 2, chunks (0, 3) on rank 0 and (1, 2) on rank 1), and the
ring's block schedule against TransformerEngine's rule."""

import pytest
import torch

from mpzero.context_parallel import ZigzagChunks, split_batch
from mpzero.context_parallel.blocks import FIRST_KEYS, LAST_QUERIES, OWN, schedule
from mpzero.errors import ConfigError

EXPECTED = {  # (seq, cp): positions of each rank, written out
    (8, 2): [[0, 1, 6, 7], [2, 3, 4, 5]],
    (16, 4): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    (12, 3): [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]],
}


@pytest.mark.parametrize("seq,cp", list(EXPECTED))
def test_positions_match_the_head_tail_assignment(seq, cp):
    for rank in range(cp):
        layout = ZigzagChunks(seq, cp, rank)
        assert layout.positions().tolist() == EXPECTED[seq, cp][rank]
        assert layout.take(torch.arange(seq)[None] * 10).tolist() == [[10 * p for p in EXPECTED[seq, cp][rank]]]


@pytest.mark.parametrize("seq,cp", list(EXPECTED))
def test_chunk_orders_restore_the_sequence_from_the_ranks_in_rank_order(seq, cp):
    layouts = [ZigzagChunks(seq, cp, r) for r in range(cp)]
    c = seq // (2 * cp)
    rank_major = torch.cat([layout.positions() for layout in layouts]).view(2 * cp, c)
    order = layouts[0].natural_chunk_order()
    assert rank_major[order].flatten().tolist() == list(range(seq))
    assert torch.arange(seq).view(2 * cp, c)[layouts[0].rank_major_chunk_order()].equal(rank_major)


def test_split_batch_gives_inputs_and_labels_at_each_ranks_positions():
    tokens = torch.arange(2 * 9).view(2, 9)  # [b, s + 1], s = 8
    inputs, labels = split_batch(tokens, 2, 1)
    assert inputs.tolist() == [[2, 3, 4, 5], [11, 12, 13, 14]]
    assert labels.tolist() == [[3, 4, 5, 6], [12, 13, 14, 15]]
    inputs, labels = split_batch(tokens, 1, 0)  # CP 1: views of the one batch, as before CP
    assert inputs.data_ptr() == tokens.data_ptr() and labels.data_ptr() == tokens.data_ptr() + 8


def test_a_sequence_not_divisible_by_twice_cp_is_one_line():
    with pytest.raises(ConfigError, match=r"sequence length 12 is not divisible by 2 x --context-parallel-size 4 = 8"):
        ZigzagChunks(12, 4, 0)


def test_ring_schedule_is_own_chunks_then_half_blocks():
    # step i takes the keys of rank - i; earlier ranks: all queries x their first chunk; later: our last chunk x all
    assert schedule(0, 4) == [(0, OWN), (3, LAST_QUERIES), (2, LAST_QUERIES), (1, LAST_QUERIES)]
    assert schedule(2, 4) == [(2, OWN), (1, FIRST_KEYS), (0, FIRST_KEYS), (3, LAST_QUERIES)]
    assert schedule(1, 2) == [(1, OWN), (0, FIRST_KEYS)]
