"""How the dashboard says counts in words and numbers: one rule for every view."""
from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 block', '2 blocks', '1,024 blocks'; `many` for an irregular plural."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def rate(x: float) -> str:
    """A rate that fits a metric card's big number (about six characters at the usual width):
    '97.6', '999.9', '3.4 k', '80.1 k', '801 k', '1.2 M'."""
    if x >= 999_500:
        return f"{x / 1e6:.1f} M"
    if x >= 99_950:
        return f"{x / 1e3:.0f} k"
    if x >= 999.95:
        return f"{x / 1e3:.1f} k"
    return f"{x:.1f}"


def count(n: int) -> str:
    """A count that fits a metric card's chip beside another: exact below 10,000 ('9,999'),
    then three digits in thousands ('41.8 k', '365 k') or millions ('1.05 M')."""
    if n >= 999_500:
        return f"{n / 1e6:.3g} M"
    return f"{n:,}" if n < 10_000 else f"{n / 1e3:.3g} k"
