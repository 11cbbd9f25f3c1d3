"""How the dashboard says counts in words: one rule for every view."""
from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 block', '2 blocks', '1,024 blocks'; `many` for an irregular plural."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
