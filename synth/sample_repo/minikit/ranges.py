"""Integer ranges and sequence slicing helpers."""


def merge_intervals(intervals):
    merged = []
    for start, end in sorted(intervals):
        if start > end:
            raise ValueError("empty interval")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def chunks(items, size):
    if size <= 0:
        raise ValueError("size must be positive")
    return [items[i:i + size] for i in range(0, len(items), size)]


def windows(items, size):
    if size <= 0:
        raise ValueError("size must be positive")
    return [tuple(items[i:i + size]) for i in range(len(items) - size + 1)]


def total_length(intervals):
    length = 0
    for start, end in merge_intervals(intervals):
        length += end - start
    return length


def find_gaps(intervals, low, high):
    gaps = []
    cursor = low
    for start, end in merge_intervals(intervals):
        if start > cursor:
            gaps.append((cursor, min(start, high)))
        cursor = max(cursor, end)
        if cursor >= high:
            break
    if cursor < high:
        gaps.append((cursor, high))
    return gaps
