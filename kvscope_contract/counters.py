"""The counters every consumer of the event stream folds the same way: prefix-cache hits and
lookups, preemptions, recomputes, swaps. The dashboard's tally (app/history/mirror.py), the engine's
/metrics (engine/serve/metrics.py), the lab's fast meter and its reference (engine/lab/) all fold
events through `EventCounts.count`, so their numbers agree by construction. `StreamCounts` adds
what a client tallies besides (requests, tokens, copies, forks); a server folds it too
(`StreamCounter`) and sends it with each snapshot, so a client that a resync made skip events
keeps exact numbers (docs/protocol.md, "Clients that fall behind").
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvscope_contract import protocol as p


def hit_rate(hit_tokens: int, looked_up_tokens: int) -> float:
    """Hit tokens over tokens looked up (every admission, re-admissions after a recompute
    included); 0 before the first lookup."""
    return hit_tokens / looked_up_tokens if looked_up_tokens else 0.0


@dataclass
class EventCounts:
    looked_up_tokens: int = 0    # tokens looked up in the prefix cache at every admission
    hit_tokens: int = 0          # of those, tokens whose K/V came from the (device's) prefix cache
    preemptions: int = 0
    recomputes: int = 0          # preemptions by recompute (the rest swapped)
    swap_outs: int = 0           # sequences moved to the host pool
    swap_ins: int = 0            # and back
    swapped_out_blocks: int = 0  # blocks copied to the host pool
    swapped_in_blocks: int = 0   # and back
    host_loaded_blocks: int = 0  # prefix blocks the device missed and the host tier served (loaded back)
    host_stored_blocks: int = 0  # full blocks stored to the host tier
    host_evicted_blocks: int = 0  # blocks the host tier evicted

    def count(self, ev: p.Event, looked_up: int = 0, hit: int = 0) -> None:
        """Fold one event in. `looked_up` and `hit` are `PoolState.prefix_lookup(ev)` and
        `prefix_hit_tokens(ev)` on the pool just before `ev` (or the same rules kept another
        way, as the lab's meter does)."""
        self.looked_up_tokens += looked_up
        self.hit_tokens += hit
        match ev:
            case p.Preempt():
                self.preemptions += 1
                self.recomputes += ev.mode == "recompute"
            case p.SwapOut():
                self.swap_outs += len(ev.group)
                self.swapped_out_blocks += len(ev.mapping)
            case p.SwapIn():
                self.swap_ins += len(ev.group)
                self.swapped_in_blocks += len(ev.mapping)
            case p.OffloadLoad():
                self.host_loaded_blocks += 1
            case p.OffloadStore():
                self.host_stored_blocks += 1
            case p.OffloadEvict():
                self.host_evicted_blocks += 1

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hit_tokens, self.looked_up_tokens)

    @property
    def swapped_blocks(self) -> int:
        """Blocks copied between the pools, both ways: what swapping costs."""
        return self.swapped_out_blocks + self.swapped_in_blocks

    def lab_fields(self) -> dict[str, int]:
        """The `LabRow` fields these counters fill."""
        return dict(hit_tokens=self.hit_tokens, looked_up_tokens=self.looked_up_tokens,
                    preemptions=self.preemptions, recomputes=self.recomputes, swap_outs=self.swap_outs,
                    swap_ins=self.swap_ins, swapped_blocks=self.swapped_blocks,
                    host_hit_blocks=self.host_loaded_blocks)

    @property
    def preemptions_by_mode(self) -> dict[str, int]:
        return {"recompute": self.recomputes, "swap": self.preemptions - self.recomputes}


@dataclass
class StreamCounts(EventCounts):
    """What a client tallies of the stream (the dashboard's header, a fleet card): `EventCounts`
    plus requests, tokens and sequences. The server folds the same, so that a snapshot that
    replaces a slow client's events carries what they counted (`p.Counters`)."""
    requests: int = 0
    # the same at first admissions only (vLLM's prefix_cache_queries / _hits leave out requests
    # admitted again after a preemption); `preempted`: live sequences preempted at least once
    first_looked_up_tokens: int = 0
    first_hit_tokens: int = 0
    generated: int = 0
    cows: int = 0
    forks: int = 0
    finished: int = 0
    preempted: set = field(default_factory=set, repr=False)

    def count(self, ev: p.Event, looked_up: int = 0, hit: int = 0) -> None:
        super().count(ev, looked_up, hit)
        first = getattr(ev, "seq_id", None) not in self.preempted
        if first:
            self.first_looked_up_tokens += looked_up
        match ev:
            case p.RequestAdded():
                self.requests += 1
            case p.PrefixHit():
                self.first_hit_tokens += hit if first else 0
            case p.Cow():
                self.cows += 1
            case p.Fork():
                self.forks += 1
            case p.Preempt():
                self.preempted.add(ev.seq_id)
            case p.Append() if ev.token_ids:
                self.generated += len(ev.token_ids)
            case p.Finish():
                self.finished += 1
                self.preempted.discard(ev.seq_id)

    @property
    def first_hit_rate(self) -> float:
        """Hit tokens over tokens looked up at first admissions: vLLM's own prefix-cache hit rate."""
        return hit_rate(self.first_hit_tokens, self.first_looked_up_tokens)

    def numbers(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in STREAM_COUNTERS}

    def wire(self, since: int) -> p.Counters:
        return p.Counters(since=since, preempted=sorted(self.preempted), **self.numbers())


# the fields that count events (not the set of preempted sequences)
STREAM_COUNTERS = tuple(f.name for f in fields(StreamCounts) if f.name != "preempted")


class StreamCounter:
    """The server's tally of what it publishes, counted from its start or its last `reset`, for
    the snapshots it sends (`wire`). Feed it every event with the pool just before it."""

    def __init__(self) -> None:
        self.counts, self.since = StreamCounts(), 0

    def observe(self, ev: p.Event, state) -> None:
        """`state`: the PoolState just before `ev` (its prefix lookup and hit are read there)."""
        if isinstance(ev, p.Reset):
            self.counts, self.since = StreamCounts(), ev.seq
        else:
            self.counts.count(ev, state.prefix_lookup(ev), state.prefix_hit_tokens(ev))

    def wire(self) -> p.Counters:
        return self.counts.wire(self.since)
