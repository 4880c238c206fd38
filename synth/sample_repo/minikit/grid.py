"""Small 2-D grids as lists of lists."""


def transpose(grid):
    if not grid:
        return []
    return [[row[c] for row in grid] for c in range(len(grid[0]))]


def neighbours(grid, r, c):
    out = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        nr, nc = r + dr, c + dc
        if 0 <= nr < len(grid) and 0 <= nc < len(grid[0]):
            out.append((nr, nc))
    return out


def flood_fill(grid, r, c, new):
    old = grid[r][c]
    if old == new:
        return grid
    stack = [(r, c)]
    while stack:
        cr, cc = stack.pop()
        if grid[cr][cc] != old:
            continue
        grid[cr][cc] = new
        stack.extend(neighbours(grid, cr, cc))
    return grid


def count_value(grid, value):
    total = 0
    for row in grid:
        for cell in row:
            if cell == value:
                total += 1
    return total


def rotate(grid):
    return [list(row) for row in zip(*grid[::-1])]
