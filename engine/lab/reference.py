"""The lab's numbers computed the slow, obvious way: from an event stream, with the contract's
reducer and its block counts at every `step` event. Works on any stream (the live engine's, a
recording's, the lab's own step-by-step run); tests compare the lab's fast counts with it."""
from __future__ import annotations

from kvscope_contract import protocol as p
from kvscope_contract.counters import EventCounts
from kvscope_contract.lab import LabConfig, LabRow
from kvscope_contract.state import PoolState


def row_from_events(config: LabConfig, start: p.Snapshot, events: list[p.AnyEvent]) -> LabRow:
    state = PoolState.from_snapshot(start)
    bs = state.config.block_size
    steps = peak_used = peak_entries = 0
    sum_used = sum_held = sum_entries = 0
    computed = finished = 0
    counts = EventCounts()
    first_hit = first_looked_up = 0
    recomputed: set[str] = set()  # preempted by recompute: their admissions are not first ones
    for ev in events:
        looked_up, hit = state.prefix_lookup(ev), state.prefix_hit_tokens(ev)
        counts.count(ev, looked_up, hit)
        if getattr(ev, "seq_id", None) not in recomputed:
            first_looked_up, first_hit = first_looked_up + looked_up, first_hit + hit
        state.apply(ev)
        match ev:
            case p.Preempt(mode="recompute"):
                recomputed.add(ev.seq_id)
            case p.Finish():
                finished += 1
                recomputed.discard(ev.seq_id)
            case p.StepDone():
                used = state.counts().used
                held = state.tokens_in_used_blocks()
                entries = sum(b >= 0 for s in state.seqs.values() for t in s.block_tables for b in t)
                steps += 1
                sum_used, sum_held, sum_entries = sum_used + used, sum_held + held, sum_entries + entries
                peak_used, peak_entries = max(peak_used, used), max(peak_entries, entries)
                computed += ev.prefill_tokens + ev.decode_tokens
    n = max(1, steps)
    return LabRow(config=config, steps=steps, peak_used=peak_used, mean_used=sum_used / n,
                  slot_util=sum_held / (sum_used * bs) if sum_used else 1.0, **counts.lab_fields(),
                  computed_tokens=computed, peak_entries=peak_entries,
                  mean_entries=sum_entries / n, finished=finished, first_hit_tokens=first_hit,
                  first_looked_up_tokens=first_looked_up)
