from minikit.grid import count_value, flood_fill, neighbours, rotate, transpose


def test_transpose():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
    assert transpose([]) == []


def test_neighbours_corner_and_middle():
    grid = [[0] * 3 for _ in range(3)]
    assert sorted(neighbours(grid, 0, 0)) == [(0, 1), (1, 0)]
    assert len(neighbours(grid, 1, 1)) == 4


def test_flood_fill():
    grid = [[1, 1, 0], [1, 0, 0], [0, 0, 1]]
    assert flood_fill(grid, 0, 0, 7) == [[7, 7, 0], [7, 0, 0], [0, 0, 1]]


def test_flood_fill_same_colour():
    grid = [[1, 1], [1, 1]]
    assert flood_fill(grid, 0, 0, 1) == [[1, 1], [1, 1]]


def test_count_value():
    assert count_value([[1, 2], [2, 2]], 2) == 3


def test_rotate():
    assert rotate([[1, 2], [3, 4]]) == [[3, 1], [4, 2]]
