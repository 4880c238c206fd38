"""The demo families' templates: short pure functions in the style of synth/sample_repo/minikit, each
with the calls its tests make. Expected values are not written here: `synth.families.template_bugs`
computes them by running the correct function, so a template cannot carry a wrong test.
Not here: renaming, bug injection or splits (synth/families.py).
"""

from __future__ import annotations

# (source, calls): `calls` are argument tuples written as Python source, one assert each.
TEMPLATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        """def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
""",
        ("5, 0, 10", "-3, 0, 10", "12, 0, 10", "0, 0, 10", "10, 0, 10", "7, 7, 9"),
    ),
    (
        """def sign(x):
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
""",
        ("5", "-2", "0", "1", "-1"),
    ),
    (
        """def count_above(items, limit):
    total = 0
    for item in items:
        if item > limit:
            total += 1
    return total
""",
        ("[1, 5, 7], 4", "[], 3", "[3, 3, 4], 3", "[9, 1, 8, 2], 2", "[0], 0"),
    ),
    (
        """def sum_even(items):
    total = 0
    for item in items:
        if item % 2 == 0:
            total += item
    return total
""",
        ("[1, 2, 3, 4]", "[]", "[5, 7]", "[6, 6, 1]", "[0, 10, 3]"),
    ),
    (
        """def first_index(items, target):
    for i in range(len(items)):
        if items[i] == target:
            return i
    return -1
""",
        ("[4, 5, 6], 5", "[4, 5, 6], 9", "[], 1", "[2, 2, 2], 2", "[7, 8, 9], 9"),
    ),
    (
        """def running_total(items):
    out = []
    acc = 0
    for item in items:
        acc += item
        out.append(acc)
    return out
""",
        ("[1, 2, 3]", "[]", "[5]", "[2, -2, 4]", "[0, 0, 1]"),
    ),
    (
        """def is_between(x, low, high):
    return low <= x and x <= high
""",
        ("3, 1, 5", "1, 1, 5", "5, 1, 5", "0, 1, 5", "6, 1, 5", "9, 9, 9"),
    ),
    (
        """def max_gap(items):
    best = 0
    for i in range(1, len(items)):
        gap = items[i] - items[i - 1]
        if gap > best:
            best = gap
    return best
""",
        ("[1, 4, 6]", "[]", "[5]", "[1, 2, 10, 11]", "[3, 1, 2]"),
    ),
    (
        """def count_chars(text, ch):
    n = 0
    for c in text:
        if c == ch:
            n += 1
    return n
""",
        ("'banana', 'a'", "'', 'x'", "'abc', 'd'", "'aaa', 'a'", "'xyx', 'y'"),
    ),
    (
        """def halve_all(items):
    return [item // 2 for item in items if item > 0]
""",
        ("[4, 6, 9]", "[]", "[-2, 0, 2]", "[1, 3]", "[10]"),
    ),
    (
        """def pad_left(text, width):
    if len(text) >= width:
        return text
    return ' ' * (width - len(text)) + text
""",
        ("'ab', 4", "'abcd', 2", "'', 3", "'x', 1", "'xy', 3"),
    ),
    (
        """def is_sorted(items):
    for i in range(len(items) - 1):
        if items[i] > items[i + 1]:
            return False
    return True
""",
        ("[1, 2, 3]", "[3, 1]", "[]", "[2, 2, 5]", "[1, 3, 2]", "[4]"),
    ),
    (
        """def average(items):
    if not items:
        return 0
    return sum(items) / len(items)
""",
        ("[2, 4]", "[]", "[5]", "[1, 2, 3, 6]", "[-4, 4]"),
    ),
    (
        """def last_word(text):
    words = text.split()
    if not words:
        return ''
    return words[-1]
""",
        ("'hello big world'", "''", "'one'", "'  a b  '", "'x y z'"),
    ),
    (
        """def triangle(n):
    total = 0
    for i in range(1, n + 1):
        total += i
    return total
""",
        ("3", "0", "1", "5", "10"),
    ),
    (
        """def in_range_count(items, low, high):
    return len([x for x in items if low <= x and x < high])
""",
        ("[1, 2, 3, 4], 2, 4", "[], 0, 1", "[5, 5], 5, 6", "[0, 9], 1, 9", "[3, 7, 8], 0, 8"),
    ),
    (
        """def dedupe(items):
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
""",
        ("[1, 2, 1, 3]", "[]", "[4, 4, 4]", "[5, 6]", "[2, 1, 2, 1]"),
    ),
    (
        """def both_positive(a, b):
    return a > 0 and b > 0
""",
        ("1, 2", "0, 2", "3, -1", "-1, -1", "5, 5", "2, 0"),
    ),
    (
        """def either_empty(a, b):
    return len(a) == 0 or len(b) == 0
""",
        ("'', 'x'", "'x', ''", "'x', 'y'", "'', ''", "'ab', 'cd'"),
    ),
    (
        """def scale(items, factor):
    return [item * factor for item in items]
""",
        ("[1, 2], 3", "[], 5", "[4], 0", "[-1, 2], 2", "[3, 3], 1"),
    ),
    (
        """def count_vowels(text):
    n = 0
    for c in text.lower():
        if c in 'aeiou':
            n += 1
    return n
""",
        ("'Hello'", "''", "'xyz'", "'AEIOU'", "'banana'"),
    ),
    (
        """def min_index(items):
    best = 0
    for i in range(1, len(items)):
        if items[i] < items[best]:
            best = i
    return best
""",
        ("[3, 1, 2]", "[5]", "[1, 2, 3]", "[4, 4, 0]", "[2, 1, 1]"),
    ),
    (
        """def is_palindrome(text):
    lo = 0
    hi = len(text) - 1
    while lo < hi:
        if text[lo] != text[hi]:
            return False
        lo += 1
        hi -= 1
    return True
""",
        ("'abba'", "'abc'", "''", "'racecar'", "'ab'", "'x'"),
    ),
    (
        """def power(base, exp):
    result = 1
    for _ in range(exp):
        result *= base
    return result
""",
        ("2, 3", "5, 0", "3, 1", "1, 9", "10, 2"),
    ),
    (
        """def digits_sum(n):
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
""",
        ("123", "0", "9", "505", "1000"),
    ),
    (
        """def chunk_count(size, step):
    if step <= 0:
        return 0
    return (size + step - 1) // step
""",
        ("10, 3", "9, 3", "0, 4", "5, 0", "1, 1", "7, 10"),
    ),
    (
        """def fizz(n):
    if n % 15 == 0:
        return 'fizzbuzz'
    if n % 3 == 0:
        return 'fizz'
    if n % 5 == 0:
        return 'buzz'
    return str(n)
""",
        ("15", "9", "10", "7", "30", "1"),
    ),
    (
        """def abs_diff(a, b):
    if a > b:
        return a - b
    return b - a
""",
        ("5, 3", "3, 5", "4, 4", "-2, 2", "0, 7"),
    ),
    (
        """def longest(words):
    best = ''
    for w in words:
        if len(w) > len(best):
            best = w
    return best
""",
        ("['a', 'abc', 'ab']", "[]", "['xy', 'zw']", "['', 'q']", "['one', 'three', 'two']"),
    ),
    (
        """def capped_sum(items, cap):
    total = 0
    for item in items:
        total += min(item, cap)
    return total
""",
        ("[1, 5, 9], 4", "[], 3", "[2, 2], 2", "[10], 0", "[3, 8], 5"),
    ),
    (
        """def is_leap(year):
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
""",
        ("2000", "1900", "2024", "2023", "2100", "1600"),
    ),
    (
        """def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
""",
        ("0", "1", "3", "5", "6"),
    ),
    (
        """def grade(score):
    if score >= 90:
        return 'A'
    if score >= 75:
        return 'B'
    if score >= 50:
        return 'C'
    return 'F'
""",
        ("95", "90", "80", "75", "60", "10"),
    ),
    (
        """def positives(items):
    return [x for x in items if x > 0]
""",
        ("[1, -2, 3]", "[]", "[0, 0]", "[-1, 5]", "[7, 8]"),
    ),
    (
        """def starts_with_any(text, prefixes):
    for p in prefixes:
        if text.startswith(p):
            return True
    return False
""",
        ("'hello', ['he', 'x']", "'hello', []", "'abc', ['b', 'c']", "'', ['']", "'cat', ['ca']"),
    ),
    (
        """def mid(a, b, c):
    if a <= b <= c or c <= b <= a:
        return b
    if b <= a <= c or c <= a <= b:
        return a
    return c
""",
        ("1, 2, 3", "3, 1, 2", "2, 3, 1", "5, 5, 1", "9, 4, 6"),
    ),
    (
        """def fib(n):
    a = 0
    b = 1
    for _ in range(n):
        a, b = b, a + b
    return a
""",
        ("0", "1", "2", "6", "10"),
    ),
    (
        """def percent(part, whole):
    if whole == 0:
        return 0
    return round(100 * part / whole)
""",
        ("1, 4", "0, 5", "3, 0", "5, 5", "1, 3"),
    ),
    (
        """def is_even_len(text):
    return len(text) % 2 == 0
""",
        ("''", "'a'", "'ab'", "'abc'", "'abcd'"),
    ),
    (
        """def repeat_text(text, n):
    if n <= 0:
        return ''
    return text * n
""",
        ("'ab', 2", "'x', 0", "'', 5", "'q', 1", "'ok', -1"),
    ),
    (
        """def gcd(a, b):
    while b != 0:
        a, b = b, a % b
    return a
""",
        ("12, 8", "7, 3", "10, 0", "9, 27", "14, 21"),
    ),
    (
        """def count_runs(items):
    if not items:
        return 0
    runs = 1
    for i in range(1, len(items)):
        if items[i] != items[i - 1]:
            runs += 1
    return runs
""",
        ("[1, 1, 2, 2, 1]", "[]", "[5]", "[3, 4, 5]", "[7, 7, 7]"),
    ),
    (
        """def total_length(words):
    n = 0
    for w in words:
        n += len(w)
    return n
""",
        ("['ab', 'c']", "[]", "['']", "['xyz', 'pq', 'r']", "['hello']"),
    ),
    (
        """def any_negative(items):
    for x in items:
        if x < 0:
            return True
    return False
""",
        ("[1, -1]", "[]", "[0, 2]", "[-5]", "[3, 4, -2]"),
    ),
    (
        """def swap_pairs(items):
    out = list(items)
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out
""",
        ("[1, 2, 3, 4]", "[]", "[5]", "[1, 2, 3]", "[9, 8]"),
    ),
    (
        """def ends_match(text):
    if len(text) < 2:
        return False
    return text[0] == text[-1]
""",
        ("'abca'", "'ab'", "'a'", "''", "'xx'", "'xyz'"),
    ),
    (
        """def nth_or_default(items, n, default):
    if 0 <= n < len(items):
        return items[n]
    return default
""",
        ("[1, 2, 3], 1, 0", "[1, 2, 3], 3, -1", "[], 0, 9", "[4], 0, 0", "[5, 6], -1, 7"),
    ),
    (
        """def trim_zeros(items):
    start = 0
    while start < len(items) and items[start] == 0:
        start += 1
    return items[start:]
""",
        ("[0, 0, 1, 0]", "[]", "[0, 0]", "[3, 0]", "[0, 5, 6]"),
    ),
)
