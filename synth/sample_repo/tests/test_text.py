import pytest
from minikit.text import count_words, initials, is_palindrome, slugify, truncate, wrap


def test_slugify_basic():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_separator_and_runs():
    assert slugify("  a  b--c ", sep="_") == "a_b_c"


def test_wrap_basic():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]


def test_wrap_exact_width():
    assert wrap("abcd efgh", 9) == ["abcd efgh"]


def test_wrap_bad_width():
    with pytest.raises(ValueError):
        wrap("x", 0)


def test_count_words():
    assert count_words("The cat, the hat. THE end!") == {"the": 3, "cat": 1, "hat": 1, "end": 1}


def test_truncate_short_kept():
    assert truncate("hello", 5) == "hello"


def test_truncate_long():
    assert truncate("hello world", 8) == "hello..."


def test_truncate_tiny_limit():
    assert truncate("hello world", 2) == ".."


def test_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("minikit")


def test_initials():
    assert initials("ada  king lovelace") == "AKL"
