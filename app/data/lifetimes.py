"""Block lifetimes, from the event stream (in engine steps), and their histograms.

- lifetime: from the step a block leaves the free list (alloc, copy-on-write or swap-in) to the
  step it returns to it (freed with no hash, or evicted from the prefix cache);
- idle before eviction: from the step a cached block lost its last holder to its eviction;
- reuse gap: steps between uses of a cached block (its registration, then each prefix hit);
- per request: device blocks its sequences hold (shared ones once), step by step.

vLLM reports the first three as `--kv-cache-metrics` (sampled, in seconds); here every block
counts, and each sample keeps the step it was taken at, so any window of the run has its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState

METRICS = {"lifetime": "block lifetime (alloc → free or evict)",
           "idle": "idle before eviction (last holder gone → evicted)",
           "reuse": "reuse gap (registered or hit → next hit)"}
MAX_REQUESTS = 16  # per-request series kept (the most recent requests)


@dataclass
class Lifetimes:
    state: PoolState
    born: dict[int, int] = field(default_factory=dict)       # block -> step it left the free list
    released: dict[int, int] = field(default_factory=dict)   # cached block -> step it lost its last holder
    used: dict[int, int] = field(default_factory=dict)       # cached block -> step of its last use
    samples: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {k: [] for k in METRICS})
    held: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request -> [(step, blocks)]

    @classmethod
    def from_state(cls, state: PoolState) -> Lifetimes:
        """Blocks already out of the free list count from this state's first step on."""
        lt = cls(state.clone())
        for b in np.flatnonzero((state.ref_counts > 0) | state.has_hash).tolist():
            lt.born[b] = 0
            if state.has_hash[b]:
                lt.used[b] = 0
                if not state.ref_counts[b]:
                    lt.released[b] = 0
        return lt

    @property
    def last_event(self) -> int:
        return self.state.last_event

    def apply(self, ev: p.AnyEvent) -> None:
        st, step = self.state, ev.step
        before = [int(st.ref_counts[b]) for b in _blocks(ev)]
        st.apply(ev)
        match ev:
            case p.Alloc() | p.SwapIn() | p.Cow():
                for b in _new_blocks(ev):
                    self.born[b] = step
            case p.Cached():
                self.used[ev.block_id] = step
            case p.PrefixHit():
                b = ev.block_id
                if b in self.used:
                    self._sample("reuse", step, step - self.used[b])
                self.used[b] = step
                self.released.pop(b, None)
            case p.Evict():
                b = ev.block_id
                self._sample("lifetime", step, step - self.born.pop(b, step))
                self._sample("idle", step, step - self.released.pop(b, step))
                self.used.pop(b, None)
            case p.StepDone():
                self._per_request(step)
            case p.Reset():
                for blocks in (self.born, self.released, self.used):
                    blocks.clear()
        for b, ref in zip(_blocks(ev), before):  # releases: the free list, or the cache
            if ref and not st.ref_counts[b]:
                if not st.has_hash[b]:
                    self._sample("lifetime", step, step - self.born.pop(b, step))
                else:
                    self.released[b] = step

    def _sample(self, metric: str, step: int, value: int) -> None:
        self.samples[metric].append((step, value))

    def _per_request(self, step: int) -> None:
        blocks: dict[str, set[int]] = {}
        for s in self.state.seqs.values():
            blocks.setdefault(s.request_id, set()).update(s.block_table)
        for rid, held in blocks.items():
            series = self.held.setdefault(rid, [])
            if not series or series[-1][1] != len(held):
                series.append((step, len(held)))
        for rid, series in self.held.items():
            if rid not in blocks and series[-1][1]:
                series.append((step, 0))  # finished (or swapped out / preempted): holds nothing
        while len(self.held) > MAX_REQUESTS * 2:
            idle = next((r for r, s in self.held.items() if r not in blocks), None)
            if idle is None:
                break
            del self.held[idle]

    # ------------------------------------------------------------------ reading
    def values(self, metric: str, since: int = -1, until: int | None = None) -> np.ndarray:
        """The samples of `metric` taken at steps in (since, until]."""
        return np.array([v for s, v in self.samples[metric] if s > since and (until is None or s <= until)],
                        np.int64)


def _blocks(ev: p.AnyEvent) -> list[int]:
    """Device blocks whose ref count `ev` lowers (their release is noticed after it)."""
    match ev:
        case p.Free():
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
