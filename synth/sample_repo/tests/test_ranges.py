import pytest
from minikit.ranges import chunks, find_gaps, merge_intervals, overlaps, total_length, windows


def test_merge_overlapping():
    assert merge_intervals([(5, 8), (1, 3), (2, 4)]) == [(1, 4), (5, 8)]


def test_merge_touching():
    assert merge_intervals([(1, 3), (3, 5)]) == [(1, 5)]


def test_merge_nested():
    assert merge_intervals([(1, 10), (2, 3)]) == [(1, 10)]


def test_merge_rejects_empty():
    with pytest.raises(ValueError):
        merge_intervals([(3, 1)])


def test_overlaps():
    assert overlaps((1, 5), (4, 6))
    assert not overlaps((1, 2), (2, 3))


def test_chunks():
    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_chunks_bad_size():
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_windows():
    assert windows([1, 2, 3, 4], 3) == [(1, 2, 3), (2, 3, 4)]
    assert windows([1, 2], 3) == []


def test_total_length():
    assert total_length([(0, 2), (1, 4), (10, 11)]) == 5


def test_find_gaps():
    assert find_gaps([(2, 3), (5, 7)], 0, 10) == [(0, 2), (3, 5), (7, 10)]
    assert find_gaps([(0, 10)], 0, 10) == []
