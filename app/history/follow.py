"""Views that follow the event stream with their own state (the prefix forest, block lifetimes):
kept up to date from a client's history as events arrive, and rebuilt for time travel.

A builder has `from_state(PoolState)`, `apply(event)` and `last_event`; one `Follower` per
client and view keeps the latest, so the live view costs only the new events.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, Protocol, TypeVar

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState


class Builder(Protocol):
    @property
    def last_event(self) -> int: ...

    def apply(self, ev: p.AnyEvent) -> None: ...


B = TypeVar("B", bound=Builder)


class Follower(Generic[B]):
    def __init__(self, start: Callable[[PoolState], B]):
        self.start = start
        self.lock = threading.Lock()
        self.builder: B | None = None
        self.epoch = -1

    def at(self, client, n: int | None) -> B | None:
        """The builder after event n of `client`'s history (None: its latest event). Before the
        oldest retained event there is nothing to follow from; after a gap in the stream (a
        resync), it starts again from the state the history kept there."""
        with self.lock:
            bounds = client.bounds()
            if bounds is None:
                return None
            first, last = bounds
            n = last if n is None else max(first, min(n, last))
            b = self.builder
            if b is None or self.epoch != client.epoch or not first <= b.last_event <= n:
                b = self._from(client, first)
            for ev in client.events_before(n, n - b.last_event):
                if ev.seq == b.last_event + 1:
                    b.apply(ev)
            if b.last_event < n:  # a gap: pick up from the state at n
                b = self._from(client, n)
            self.builder, self.epoch = b, client.epoch
            return b

    def _from(self, client, n: int) -> B:
        return self.start(client.view(n).mirror.state)
