"""Money in integer cents: parsing, formatting, splitting and discounts."""


def parse_cents(text):
    text = text.strip().replace(",", "")
    negative = text.startswith("-")
    if negative:
        text = text[1:]
    if text.startswith("$"):
        text = text[1:]
    whole, _, frac = text.partition(".")
    if len(frac) > 2:
        raise ValueError("too many decimal places")
    cents = int(whole or "0") * 100 + int(frac.ljust(2, "0") or "0")
    return -cents if negative else cents


def format_cents(cents):
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    dollars, rest = divmod(cents, 100)
    return f"{sign}${dollars:,}.{rest:02d}"


def split_bill(total, people):
    if people < 1:
        raise ValueError("need at least one person")
    share, remainder = divmod(total, people)
    return [share + 1 if i < remainder else share for i in range(people)]


def apply_discount(cents, percent):
    if percent < 0 or percent > 100:
        raise ValueError("percent out of range")
    return cents - cents * percent // 100


def add_tax(cents, rate_percent):
    return cents + round(cents * rate_percent / 100)
