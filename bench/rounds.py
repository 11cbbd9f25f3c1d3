"""Measurements that survive a shared, noisy machine: sides interleaved round by round (the
order rotated, so no side always goes first), reported as medians with their spread, and
A-vs-B as the median of per-round ratios (each ratio compares runs made moments apart)."""
from __future__ import annotations

import statistics
from typing import Callable, TypeVar

T = TypeVar("T")


def interleave(sides: dict[str, Callable[[], T]], rounds: int, say=None) -> dict[str, list[T]]:
    """Run every side once per round, A B, B A, A B, ...; each side's results in round order."""
    names = list(sides)
    out: dict[str, list[T]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(sides[name]())
            if say:
                say(f"  round {r + 1}: {name} {out[name][-1]}")
    return out


def spread(xs: list[float], fmt: str = ".1f") -> str:
    """'median (min..max)'."""
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def ratios(a: list[float], b: list[float]) -> list[float]:
    """b / a, round by round."""
    return [y / x for x, y in zip(a, b)]
