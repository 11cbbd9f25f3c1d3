"""Block lifetimes, from the event stream (in engine steps), and their histograms.

The rule (when a lifetime, an idle time before eviction and a reuse gap begin and end) is the
contract's (kvscope_contract/residency.py), shared with the engine's /metrics; here each sample
keeps the step it was taken at, so any window of the run has its own, and the blocks each
request holds (shared ones once) are followed step by step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.residency import Mark, Residency
from kvscope_contract.state import NULL, PoolState

METRICS = {"lifetime": "block lifetime (alloc → free or evict)",
           "idle": "idle before eviction (last holder gone → evicted)",
           "reuse": "reuse gap (registered or hit → next hit)"}
MAX_REQUESTS = 16  # per-request series kept (the most recent requests)


@dataclass
class Lifetimes:
    state: PoolState
    samples: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {k: [] for k in METRICS})
    held: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request -> [(step, blocks)]
    residency: Residency = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.residency = Residency(self._sample)

    @classmethod
    def from_state(cls, state: PoolState) -> Lifetimes:
        """Blocks already out of the free list count from this state's first step on."""
        lt = cls(state.clone())
        lt.residency.start(lt.state, Mark(0, 0.0))
        return lt

    @property
    def last_event(self) -> int:
        return self.state.last_event

    def apply(self, ev: p.AnyEvent) -> None:
        self.residency.apply(ev, self.state)
        if isinstance(ev, p.StepDone):
            self._per_request(ev.step)

    def _sample(self, metric: str, ev: p.Event, since: Mark) -> None:
        self.samples[metric].append((ev.step, ev.step - since.step))

    def _per_request(self, step: int) -> None:
        blocks: dict[str, set[int]] = {}
        for s in self.state.seqs.values():
            held = blocks.setdefault(s.request_id, set())
            for table in s.block_tables:  # every KV-cache group's (a hybrid pool's NULL entries hold none)
                held.update(table)
            held.discard(NULL)
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

