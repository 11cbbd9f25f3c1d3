"""What a KV-event stream can show, as plain data: the cached blocks per medium, the prefix
forest they form by parent hash, stored / removed / cleared counts over time, and the frames
that could not be read. No block ids, ref counts or request tables: the stream has none.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from integrations.kv_events.decode import Batch, Cleared, Removed, Stored


@dataclass
class CachedBlock:
    hash: str
    parent: str | None
    token_ids: list[int]
    medium: str
    stored_at: float
    copies: int = 1  # vLLM does not de-duplicate: two physical blocks may cache the same content


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
    blocks: dict[tuple[str, str], CachedBlock] = field(default_factory=dict)  # (medium, hash)
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
                    self._store(ev, batch.ts)
                case Removed():
                    for h in ev.hashes:
                        self._remove((ev.medium, h))
                case Cleared():
                    gone = [k for k in self.blocks if ev.medium is None or k[0] == ev.medium]
                    for k in gone:
                        del self.blocks[k]
                    self.cleared += 1
        self.unknown_events += len(batch.unknown)
        self.errors.extend(batch.unknown)
        self.batches += 1
        self.points.append(Point(batch.ts, self.stored, self.removed, self.cleared, self.num_cached()))

    def _store(self, ev: Stored, ts: float) -> None:
        parent = ev.parent
        for i, h in enumerate(ev.hashes):
            if (b := self.blocks.get((ev.medium, h))) is not None:
                b.copies += 1
            else:
                tokens = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
                self.blocks[(ev.medium, h)] = CachedBlock(h, parent, tokens, ev.medium, ts)
            parent = h
            self.stored += 1

    def _remove(self, key: tuple[str, str]) -> None:
        self.removed += 1
        b = self.blocks.get(key)
        if b is None:
            self.removed_unknown += 1
        elif b.copies > 1:
            b.copies -= 1
        else:
            del self.blocks[key]

    def bad_frame(self, why: str) -> None:
        self.bad_frames += 1
        self.errors.append(why)

    def num_cached(self) -> int:
        return sum(b.copies for b in self.blocks.values())

    def per_medium(self) -> dict[str, int]:
        """Cached physical blocks per medium (copies of the same content counted)."""
        n: Counter = Counter()
        for (medium, _), b in self.blocks.items():
            n[medium] += b.copies
        return dict(n)

    def forest(self, medium: str | None = None) -> dict[str | None, list[CachedBlock]]:
        """Children by parent hash; a block whose parent is not cached hangs from None (a root)."""
        blocks = [b for b in self.blocks.values() if medium is None or b.medium == medium]
        present = {b.hash for b in blocks}
        kids: dict[str | None, list[CachedBlock]] = {}
        for b in sorted(blocks, key=lambda b: b.stored_at):
            kids.setdefault(b.parent if b.parent in present else None, []).append(b)
        return kids
