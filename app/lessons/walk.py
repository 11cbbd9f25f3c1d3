"""Moving through a lesson's stops, for both kinds of lesson run: which stops were reached, which
one is shown, and what Next and Back do. A stop reached once is shown again from what was kept,
never rerun; Next runs the engine(s) only past the last stop reached.

One click moves one stop: Streamlit can deliver a click to two script runs, so each click says
which stop was shown when it was drawn (`seen`), and a click drawn at another stop moves nothing.
"""
from __future__ import annotations

from typing import Protocol


class _Script(Protocol):
    stops: list


class StopWalk:
    """The stop navigation a lesson run inherits; it keeps `lesson` (with `stops`), `reached`
    (one entry per stop reached, in order), `viewing` (-1: the introduction) and `pending` (a
    stop being run to, or None)."""
    lesson: _Script
    reached: list
    viewing: int
    pending: object | None

    @property
    def done(self) -> bool:
        return len(self.reached) == len(self.lesson.stops) and self.pending is None

    @property
    def stop(self):
        return self.lesson.stops[self.viewing] if self.viewing >= 0 else None

    @property
    def at_end(self) -> bool:
        """Every stop reached and the last one shown: Next has nowhere to go."""
        return self.done and self.viewing == len(self.lesson.stops) - 1

    @property
    def at_latest(self) -> bool:
        """The stop shown is the last one reached (not one travelled back to)."""
        return self.viewing == len(self.reached) - 1

    def forward(self, seen: int | None = None) -> bool:
        """Show the next stop reached already; True when there is none and the next stop is to be
        run to (the caller runs it)."""
        if self.pending is not None or seen not in (None, self.viewing):
            return False
        if self.viewing + 1 < len(self.reached):
            self.viewing += 1
            return False
        return len(self.reached) < len(self.lesson.stops)

    def backward(self, seen: int | None = None) -> None:
        """Show the previous stop reached."""
        if self.pending is None and self.viewing > 0 and seen in (None, self.viewing):
            self.viewing -= 1
