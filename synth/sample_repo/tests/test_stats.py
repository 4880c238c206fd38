import pytest
from minikit.stats import clamp, mean, median, percentile, running_max, variance


def test_mean_basic():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_empty_raises():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_median_empty_raises():
    with pytest.raises(ValueError):
        median([])


def test_variance_sample():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == pytest.approx(32 / 7)


def test_variance_population():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9], sample=False) == pytest.approx(4.0)


def test_variance_too_short():
    with pytest.raises(ValueError):
        variance([1])


def test_clamp_inside_and_edges():
    assert clamp(5, 0, 10) == 5
    assert clamp(-3, 0, 10) == 0
    assert clamp(12, 0, 10) == 10
    assert clamp(10, 0, 10) == 10


def test_clamp_bad_bounds():
    with pytest.raises(ValueError):
        clamp(1, 5, 2)


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([10, 20, 30, 40], 25) == pytest.approx(17.5)
    assert percentile([10, 20, 30, 40], 100) == 40


def test_percentile_range_checked():
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


def test_running_max():
    assert running_max([3, 1, 4, 1, 5, 2]) == [3, 3, 4, 4, 5, 5]
