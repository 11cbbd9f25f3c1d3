"""What a KV-event stream can show, as plain data: per medium, the prefix forest its cached
blocks form by parent hash (kvscope_contract/prefix_forest.py, each node with its token ids and
its copies: vLLM does not de-duplicate, so two physical blocks may cache the same content),
stored / removed / cleared counts over time, and the frames that could not be read. No block
ids, ref counts or request tables: the stream has none.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvscope_contract.prefix_forest import PrefixForest
from integrations.kv_events.decode import Batch, Cleared, Removed, Stored


@dataclass
class Point:
    """Counts after one batch, for the rates chart."""
    ts: float
    stored: int
    removed: int
    cleared: int
    cached: int


@dataclass
class KVEventsState:
    forests: dict[str, PrefixForest] = field(default_factory=dict)  # medium -> its cached blocks
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    removed_unknown: int = 0    # removals of blocks this subscriber never saw stored (it joined late)
    batches: int = 0
    last_seq: int = -1
    missed: int = 0             # batches skipped in the sequence numbers (dropped by ZMQ)
    bad_frames: int = 0
    unknown_events: int = 0
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    points: deque[Point] = field(default_factory=lambda: deque(maxlen=5000))

    def apply(self, batch: Batch) -> None:
        if batch.seq >= 0:
            if self.last_seq >= 0 and batch.seq > self.last_seq + 1:
                self.missed += batch.seq - self.last_seq - 1
            self.last_seq = max(self.last_seq, batch.seq)
        for ev in batch.events:
            match ev:
                case Stored():
                    self._store(ev)
                case Removed():
                    forest = self.forests.get(ev.medium)
                    for h in ev.hashes:
                        self.removed += 1
                        if forest is None or not forest.remove(h):
                            self.removed_unknown += 1
                case Cleared():
                    for medium, forest in self.forests.items():
                        if ev.medium is None or medium == ev.medium:
                            forest.clear()
                    self.cleared += 1
        self.unknown_events += len(batch.unknown)
        self.errors.extend(batch.unknown)
        self.batches += 1
        self.points.append(Point(batch.ts, self.stored, self.removed, self.cleared, self.num_cached()))

    def _store(self, ev: Stored) -> None:
        forest = self.forests.setdefault(ev.medium, PrefixForest())
        parent, size = ev.parent, ev.block_size
        for i, h in enumerate(ev.hashes):
            self.stored += 1  # the clock of the forest: blocks stored so far
            forest.store(h, parent, medium=ev.medium, at=self.stored, tokens=ev.token_ids[i * size:(i + 1) * size])
            parent = h

    def bad_frame(self, why: str) -> None:
        self.bad_frames += 1
        self.errors.append(why)

    def num_cached(self) -> int:
        return sum(self.per_medium().values())

    def per_medium(self) -> dict[str, int]:
        """Cached physical blocks per medium (copies of the same content counted)."""
        return {m: n for m, f in self.forests.items() if (n := f.copies())}
