"""Measurements that survive a shared, noisy machine: sides interleaved round by round (the
order rotated, so no side always goes first), reported as medians with their spread, and
A-vs-B as the median of per-round ratios (each ratio compares runs made moments apart)."""
from __future__ import annotations

import statistics
import time
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


def _busy_and_total() -> tuple[int, int]:
    """All CPUs' busy and total time so far, in clock ticks (Linux /proc/stat)."""
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


def settle(busy_share: float = 0.2, window: float = 0.1, limit: float = 5.0) -> float:
    """Wait until the machine is idle: the CPUs busy under `busy_share` of their time over one
    `window`, for at most `limit` seconds; returns the seconds waited. A side's leftovers would
    otherwise slow the next side's run (vLLM's engine core keeps a core busy for about a second
    after each request). Without /proc/stat it returns at once."""
    start = time.monotonic()
    try:
        before = _busy_and_total()
    except OSError:
        return 0.0
    while time.monotonic() - start < limit:
        time.sleep(window)
        after = _busy_and_total()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total and busy / total < busy_share:
            break
        before = after
    return time.monotonic() - start


def spread(xs: list[float], fmt: str = ".1f") -> str:
    """'median (min..max)'."""
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def ratios(a: list[float], b: list[float]) -> list[float]:
    """b / a, round by round."""
    return [y / x for x, y in zip(a, b)]
