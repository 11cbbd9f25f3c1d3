"""The counters every consumer of the event stream folds the same way: prefix-cache hits and
lookups, preemptions, recomputes, swaps. The dashboard's tally (app/history/mirror.py), the engine's
/metrics (engine/serve/metrics.py), the lab's fast meter and its reference (engine/lab/) all fold
events through `EventCounts.count`, so their numbers agree by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

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
