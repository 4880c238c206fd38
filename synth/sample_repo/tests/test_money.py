import pytest
from minikit.money import add_tax, apply_discount, format_cents, parse_cents, split_bill


def test_parse_plain():
    assert parse_cents("12.34") == 1234


def test_parse_symbol_commas_negative():
    assert parse_cents("-$1,234.5") == -123450


def test_parse_too_precise():
    with pytest.raises(ValueError):
        parse_cents("1.234")


def test_format():
    assert format_cents(123456) == "$1,234.56"
    assert format_cents(-5) == "-$0.05"


def test_split_even():
    assert split_bill(900, 3) == [300, 300, 300]


def test_split_remainder():
    assert split_bill(1000, 3) == [334, 333, 333]


def test_split_nobody():
    with pytest.raises(ValueError):
        split_bill(100, 0)


def test_discount():
    assert apply_discount(1000, 15) == 850
    assert apply_discount(999, 0) == 999


def test_discount_range():
    with pytest.raises(ValueError):
        apply_discount(100, 101)


def test_add_tax():
    assert add_tax(1000, 8) == 1080
    assert add_tax(999, 10) == 1099
