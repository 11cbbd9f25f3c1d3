"""Block residency read off the event stream: when a block's lifetime, its idle time before
eviction and its reuse gaps begin and end. One rule for every consumer: the dashboard's
lifetimes view counts them in engine steps (app/derived/lifetimes.py), the engine's /metrics in
seconds under vLLM's names (engine/serve/metrics.py).

- lifetime: from the event a block leaves the free list (alloc, copy-on-write or swap-in) to the
  event it returns to it (freed with no hash, or evicted from the prefix cache);
- idle before eviction: from the event a cached block lost its last holder to its eviction;
- reuse gap: between uses of a cached block (its registration, then each prefix hit).

vLLM's `--kv-cache-metrics` samples 1% of the blocks, ends a lifetime only when the block is
handed out again and counts gaps between prefix hits only; here every block counts.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState

METRICS = ("lifetime", "idle", "reuse")


class Mark(NamedTuple):
    """When something began: the engine step and the engine time of the event."""
    step: int
    t: float

    @classmethod
    def of(cls, ev: p.Event) -> Mark:
        return cls(ev.step, ev.t)


# metric, the event that ends the interval, the mark it began at
Sample = Callable[[str, p.Event, Mark], None]


class Residency:
    def __init__(self, sample: Sample):
        self.sample = sample
        self.born: dict[int, Mark] = {}      # block -> when it left the free list
        self.released: dict[int, Mark] = {}  # cached block -> when it lost its last holder
        self.used: dict[int, Mark] = {}      # cached block -> its last use

    def start(self, state: PoolState, since: Mark) -> None:
        """Begin at `state`: the blocks already out of the free list count from `since`."""
        for marks in (self.born, self.released, self.used):
            marks.clear()
        for b in np.flatnonzero((state.ref_counts > 0) | state.has_hash).tolist():
            self.born[b] = since
            if state.has_hash[b]:
                self.used[b] = since
                if not state.ref_counts[b]:
                    self.released[b] = since

    def apply(self, ev: p.AnyEvent, state: PoolState) -> None:
        """Apply `ev` to `state` (the pool before it) and take the samples it ends."""
        blocks = _releasable(ev)
        before = [int(state.ref_counts[b]) for b in blocks]
        state.apply(ev)
        now = Mark.of(ev)
        match ev:
            case p.Alloc() | p.SwapIn() | p.Cow():
                for b in _new_blocks(ev):
                    self.born[b] = now
            case p.Cached():
                self.used[ev.block_id] = now
            case p.PrefixHit():
                b = ev.block_id
                if b in self.used:
                    self.sample("reuse", ev, self.used[b])
                self.used[b] = now
                self.released.pop(b, None)
            case p.Evict():
                b = ev.block_id
                self.sample("lifetime", ev, self.born.pop(b, now))
                self.sample("idle", ev, self.released.pop(b, now))
                self.used.pop(b, None)
            case p.Reset():
                for marks in (self.born, self.released, self.used):
                    marks.clear()
        for b, ref in zip(blocks, before):  # releases: to the free list, or to the cache
            if ref and not state.ref_counts[b]:
                if not state.has_hash[b]:
                    self.sample("lifetime", ev, self.born.pop(b, now))
                else:
                    self.released[b] = now


def _releasable(ev: p.AnyEvent) -> list[int]:
    """Device blocks whose ref count `ev` lowers (their release is noticed after it)."""
    match ev:
        case p.Free() | p.WindowFree():
            return [ev.block_id]
        case p.Cow():
            return [ev.src_block_id]
        case p.SwapOut():
            return [d for d, _ in reversed(ev.mapping + ev.shared)]
    return []


def _new_blocks(ev: p.AnyEvent) -> list[int]:
    match ev:
        case p.Alloc():
            return [ev.block_id]
        case p.Cow():
            return [ev.dst_block_id]
        case p.SwapIn():
            return [d for _, d in ev.mapping]
    return []
