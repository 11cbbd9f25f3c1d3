"""Bounded event history with periodic checkpoints: the state at any retained event number.

The state at event N is the nearest checkpoint at or before N with the events after it
replayed (the reducer is a pure function of the events). A snapshot that does not continue
the stream (a resync after a gap) becomes a checkpoint too, so travel never crosses a gap.

The history is cut into segments, each starting at a `reset` or at a clean slate (a mark of
this client's: the counters start again there, the pool is untouched); the timeline draws
the segment of the viewed event.

Memory is bounded: at most `max_events` events (a million), packed (app/history/event_store.py:
about 100 bytes each, plus 16 chunks of 4,096 kept as objects), checkpoints worth at most
`checkpoint_bytes` (384 MiB: when they would take more, every other one goes and the spacing
doubles, so a big pool gets fewer, farther checkpoints), 20,000 timeline points and 5,000
markers. docs/benchmarks.md measures it with a million events at 131,072 blocks.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from kvscope_contract import protocol as p
from kvscope_contract.kinds import MARKER_KINDS, kind_of
from kvscope_contract.state import used_blocks
from app.history.event_store import EventStore
from app.history.mirror import Mirror

MAX_STEP_POINTS = 20_000  # timeline points kept (one per engine step)
MAX_MARKERS = 5_000       # timeline markers kept (preemptions, swaps, resets)


@dataclass(frozen=True)
class StepPoint:
    """One engine step, for the timeline chart."""
    seq: int
    step: int
    t: float
    used: int
    cached: int
    free: int
    running: int
    waiting: int
    swapped: int
    hit_rate: float
    tokens_per_s: float


@dataclass(frozen=True)
class Marker:
    seq: int
    step: int
    kind: str
    seq_id: str


class EventHistory:
    def __init__(self, snap: p.Snapshot, max_events: int = 1_000_000, checkpoint_every: int = 500,
                 checkpoint_bytes: int = 384 << 20):
        self.max_events, self.checkpoint_every = max_events, checkpoint_every
        self.checkpoint_bytes = checkpoint_bytes
        self.live = Mirror.from_snapshot(snap)
        self.events = EventStore()
        self.checkpoints: list[Mirror] = [self.live.clone()]
        self.points: deque[StepPoint] = deque(maxlen=MAX_STEP_POINTS)
        self.markers: deque[Marker] = deque(maxlen=MAX_MARKERS)
        self.segment_starts: list[int] = [self.live.last_event]  # resets and clean slates, rising
        self.clean_slates: dict[int, str] = {}  # event -> the tally's `since` label from there on

    # ------------------------------------------------------------------ writing
    def append(self, ev: p.AnyEvent) -> None:
        """Apply a live event; raises kvscope_contract.state.InvariantError when it cannot follow."""
        self.live.apply(ev)
        self.events.append(ev)
        kind = kind_of(ev)
        if kind == "reset":
            self.segment_starts.append(ev.seq)
        if kind in MARKER_KINDS:
            self.markers.append(Marker(ev.seq, ev.step, kind, getattr(ev, "seq_id", "")))
        elif kind == "step":
            cfg, tl = self.live.config, self.live.tally
            self.points.append(StepPoint(
                ev.seq, ev.step, ev.t, used_blocks(cfg, ev.free_blocks, ev.cached_blocks),
                ev.cached_blocks, ev.free_blocks, ev.num_running, ev.num_waiting, ev.num_swapped,
                tl.hit_rate, tl.tokens_per_s()))
        if ev.seq - self.checkpoints[-1].last_event >= self.checkpoint_every:
            self.checkpoints.append(self.live.clone())
            self._thin()
        if len(self.events) > self.max_events * 1.1:  # trim in chunks: O(1) amortised
            del self.events[:len(self.events) - self.max_events]
            # checkpoints before the first retained event can no longer be replayed forward
            stale = bisect.bisect_left(self.checkpoints, self.events[0].seq - 1, key=lambda m: m.last_event)
            del self.checkpoints[:min(stale, len(self.checkpoints) - 1)]

    def clean_slate(self) -> int:
        """Start counting afresh at the live event (the history before stays reachable)."""
        n = self.live.last_event
        self.clean_slates[n] = f"the clean slate (event {n:,})"
        if self.segment_starts[-1] != n:
            self.segment_starts.append(n)
        self.live.start_tally(self.clean_slates[n])
        return n

    def segment_start(self, n: int) -> int:
        """Where the segment holding event n starts (the event before its first)."""
        i = bisect.bisect_right(self.segment_starts, n - 1) - 1
        return self.segment_starts[max(i, 0)]

    def _mark(self, mirror: Mirror) -> None:
        if (since := self.clean_slates.get(mirror.last_event)) and mirror.tally.since != since:
            mirror.start_tally(since)

    def _thin(self) -> None:
        """Every other checkpoint goes (never the first or the last) while they take more than
        `checkpoint_bytes` (each one about the size of the live state and its table origins);
        the spacing of new ones doubles."""
        each = self.live.state.nbytes() + 60 * sum(map(len, self.live.origins.values()))
        while len(self.checkpoints) > 2 and len(self.checkpoints) * each > self.checkpoint_bytes:
            self.checkpoints[1:-1] = self.checkpoints[2:-1:2]
            self.checkpoint_every *= 2

    def resync(self, snap: p.Snapshot) -> None:
        """A snapshot in mid-stream: it becomes the live state and a checkpoint, keeping the
        counters (with what the events it skipped counted, from its own) and the history before it."""
        old = self.live
        self.live = Mirror.from_snapshot(snap)
        self.live.carry_on(old, snap.counters)
        while self.checkpoints and self.checkpoints[-1].last_event >= snap.seq:
            self.checkpoints.pop()
        self.checkpoints.append(self.live.clone())

    # ------------------------------------------------------------------ reading
    @property
    def first_event(self) -> int:
        """The earliest event number whose state can be rebuilt."""
        return self.checkpoints[0].last_event

    @property
    def last_event(self) -> int:
        return self.live.last_event

    def _index(self, seq: int) -> int:
        """Position of the first retained event numbered >= seq."""
        return self.events.bisect_left(seq)

    def at(self, n: int) -> Mirror:
        """A copy of the state right after event n (clamped to what is retained)."""
        n = max(self.first_event, min(n, self.last_event))
        if n == self.last_event:
            return self.live.clone()
        i = bisect.bisect_right(self.checkpoints, n, key=lambda m: m.last_event) - 1
        mirror = self.checkpoints[i].clone()
        self._mark(mirror)
        for ev in self.events[self._index(mirror.last_event + 1):self._index(n + 1)]:
            if ev.seq != mirror.last_event + 1:
                break  # a gap: the checkpoint after it is later than n
            mirror.apply(ev)
            self._mark(mirror)
        return mirror

    def event(self, n: int) -> p.AnyEvent | None:
        i = self._index(n)
        return self.events[i] if i < len(self.events) and self.events[i].seq == n else None

    def last_step_events(self, n: int, limit: int = 20_000) -> list[p.AnyEvent]:
        """The events of the engine step that event n belongs to, up to n, never reaching back
        past a reset (the blocks they name may no longer exist)."""
        end = self._index(n + 1)
        if not end:
            return []
        size = 256
        while True:  # windows that grow until they hold the step's start (never before a reset)
            window = self.events[max(0, end - size):end]
            step, i = window[-1].step, len(window) - 1
            while i > 0 and window[i - 1].step == step and not isinstance(window[i], p.Reset):
                i -= 1
            if i > 0 or len(window) == end or size >= limit:
                return window[i:][-limit:]
            size *= 4

    def step_events(self, n: int, limit: int = 20_000) -> list[p.AnyEvent]:
        """Every event of the engine step that event n belongs to, as far as received: those up to
        n (`last_step_events`) and those after it in the same step. A key event is told with its
        whole step: every block of an admission's prefix hit, not only those up to the first."""
        out = self.last_step_events(n, limit)
        if not out:
            return []
        i, step, events = self._index(n + 1), out[-1].step, self.events
        while i < len(events) and len(out) < limit:
            ev = events[i]
            if ev.step != step or isinstance(ev, p.Reset):
                break
            out.append(ev)
            i += 1
        return out

    def step_edge(self, n: int, forward: bool) -> int:
        """Forward: the last event of n's step, or of the next step if n already ends its own.
        Backward: the last event of the step before n's."""
        events, i = self.events, self._index(n)
        if i >= len(events):
            return self.last_event if forward else n
        step = events[i].step
        if forward:
            if i + 1 < len(events) and events[i + 1].step == step:
                while i + 1 < len(events) and events[i + 1].step == step:
                    i += 1
                return events[i].seq
            if i + 1 >= len(events):
                return self.last_event
            i, step = i + 1, events[i + 1].step
            while i + 1 < len(events) and events[i + 1].step == step:
                i += 1
            return events[i].seq
        while i >= 0 and events[i].step == step:
            i -= 1
        return events[i].seq if i >= 0 else self.first_event

    def recent(self, n: int, count: int) -> list[p.AnyEvent]:
        """Up to `count` events at or before n, oldest first."""
        end = self._index(n + 1)
        return self.events[max(0, end - count):end]
