"""The engine's event log: numbers, stamps and buffers every allocator event in order."""
from __future__ import annotations

import time

from kvscope_contract.protocol import Event


class EventLog:
    """`emit` stamps `seq` (one more than the last), `t` and `step`; `drain` hands the buffer out.

    Only the engine thread emits, so there is no lock; the server drains after each step.
    """

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seq = 0
        self.step = 0
        self.pending: list[Event] = []

    def emit(self, ev: Event) -> None:
        self.seq += 1
        ev.seq, ev.t, ev.step = self.seq, round(time.monotonic() - self.t0, 6), self.step
        self.pending.append(ev)

    def drain(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out
