"""A reference model of the host tier's semantics (docs/offload.md), and a model-free engine to
drive the real tier through the real scheduler: what the offload tests compare."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.engine_core import EngineCore
from engine.core.sequence import Sequence
from kvscope_contract import protocol as p


@dataclass
class ReferenceTier:
    """The tier as its documentation states it, in lists: `ready` in LRU order (least recent first),
    `pending` stored this step (not loadable, not evictable), at most `capacity` keys in all."""
    capacity: int
    ready: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    evicted: list = field(default_factory=list)  # every key evicted, in order

    def touch(self, key) -> None:
        if key in self.ready:
            self.ready.remove(key)
            self.ready.append(key)

    def store(self, key) -> bool:
        """Whether the key is stored now (False: held already, touched; or no room)."""
        if key in self.ready or key in self.pending:
            self.touch(key)
            return False
        if len(self.ready) + len(self.pending) == self.capacity:
            if not self.ready:
                return False
            self.evicted.append(self.ready.pop(0))
        self.pending.append(key)
        return True

    def load(self, key) -> bool:
        """Whether a lookup of the key hits (then it is the most recently used)."""
        if key not in self.ready:
            return False
        self.touch(key)
        return True

    def end_step(self) -> None:
        self.ready += self.pending
        self.pending = []


class CountingEngine(EngineCore):
    """The engine core with a counter for a model: sequence i's next token is a function of its
    length, so every run of the same prompts samples the same tokens, whatever the pools do."""

    def _sample(self, seq: Sequence, payload) -> int:
        return (len(seq) * 7 + 3) % 50


def counting_engine(**pool) -> CountingEngine:
    budget = pool.pop("budget", 256)
    return CountingEngine(p.PoolConfig(**pool), max_num_batched_tokens=budget)
