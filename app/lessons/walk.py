"""Moving through a lesson's stops, for both kinds of lesson run: which stops were reached, which
one is shown, and what Next and Back do. A stop reached once is shown again from what was kept,
never rerun; Next runs the engine(s) only past the last stop reached.

One click moves one stop: Streamlit can deliver a click to two script runs, so each click says
which stop was shown when it was drawn (`seen`), and a click drawn at another stop moves nothing.
"""
from __future__ import annotations

import threading
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


class ThreadedWalk(StopWalk):
    """A walk whose new stops are run on a thread of their own (the fleet and trace lessons: a stop
    takes seconds to minutes and the page polls `pending`): `_reach(index)` runs one, appends to
    `reached` and sets `viewing`, or appends to `errors`, and clears `pending` either way. It
    keeps `progress` (what the pending stop does, in words) and `errors` (Next stops at one)."""
    progress: str
    errors: list[str]
    _thread: threading.Thread | None

    def next(self, seen: int | None = None) -> None:
        """Show the next stop: one reached already, or run to a new one (on a thread)."""
        if not self.forward(seen) or self.errors:
            return
        self.pending = len(self.reached)
        self.progress = "starting"
        self._thread = threading.Thread(target=self._reach, args=(self.pending,), daemon=True,
                                        name=type(self).__name__)
        self._thread.start()

    def back(self, seen: int | None = None) -> None:
        self.backward(seen)

    def wait(self, timeout: float = 600.0) -> None:
        """Until the stop in progress is reached (for scripts and tests)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _reach(self, index: int) -> None:
        raise NotImplementedError

    def outline(self) -> str:
        """The stops on one line (Markdown): the one shown bold, ✓ reached, … being run to."""
        def one(i: int, title: str) -> str:
            bold = "**" if i == self.viewing else ""
            mark = " ✓" if i < len(self.reached) else " …" if self.pending == i else ""
            return f"{bold}{i + 1}. {title}{bold}{mark}"
        return " · ".join(one(i, s.title) for i, s in enumerate(self.lesson.stops))
