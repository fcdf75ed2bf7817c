import pytest

from pipeline import PipelineLayout, chunks_of_rank, split_layers


@pytest.mark.parametrize("L,C,first,last,expected", [
    (8, 4, None, None, [2, 2, 2, 2]),
    (10, 4, None, None, [3, 3, 2, 2]),
    (10, 4, 3, 1, [3, 3, 3, 1]),
    (9, 4, 0, None, [0, 3, 3, 3]),
    (7, 4, None, 1, [2, 2, 2, 1]),
    (5, 1, None, None, [5]),
], ids=lambda v: str(v))
def test_split_layers(L, C, first, last, expected):
    assert split_layers(L, C, first, last) == expected


@pytest.mark.parametrize("L,C,first,last,match", [
    (3, 4, None, None, "cannot split 3 layers into 4 chunks"),
    (8, 4, 4, 3, "1 layers left for 2 remaining chunks"),
    (4, 2, 3, 2, "-1 layers left for 0 remaining chunks"),
    (4, 1, 2, None, "one chunk holds all 4 layers"),
])
def test_split_layers_errors(L, C, first, last, match):
    with pytest.raises(ValueError, match=match):
        split_layers(L, C, first, last)


def test_loop_placement():
    lay = PipelineLayout(12, pp_size=3, vpp_size=2)
    assert lay.num_chunks == 6
    assert [lay.rank_of(c) for c in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [lay.virtual_stage_of(c) for c in range(6)] == [0, 0, 0, 1, 1, 1]
    assert lay.chunks_of_rank(1) == [1, 4] == chunks_of_rank(1, 3, 2)
    assert list(lay.layer_range(4)) == [8, 9]
    with pytest.raises(ValueError, match="cannot split 5 layers into 6 chunks"):
        PipelineLayout(5, pp_size=3, vpp_size=2)
