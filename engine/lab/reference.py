"""The lab's numbers computed the slow, obvious way: from an event stream, with the contract's
reducer and its block counts at every `step` event. Works on any stream (the live engine's, a
recording's, the lab's own step-by-step run); tests compare the lab's fast counts with it."""
from __future__ import annotations

from engine.contract import protocol as p
from engine.contract.lab import LabConfig, LabRow
from engine.contract.state import PoolState


def row_from_events(config: LabConfig, start: p.Snapshot, events: list[p.AnyEvent]) -> LabRow:
    st = PoolState.from_snapshot(start)
    bs = st.config.block_size
    steps = peak_used = peak_entries = 0
    sum_used = sum_held = sum_entries = 0
    hit = looked_up = preempt = recompute = outs = ins = moved = computed = finished = 0
    for ev in events:
        looked_up += st.prefix_lookup(ev)
        st.apply(ev)
        match ev:
            case p.PrefixHit():
                hit += bs
            case p.Preempt():
                preempt += 1
                recompute += ev.mode == "recompute"
            case p.SwapOut():
                outs += 1
                moved += len(ev.mapping)
            case p.SwapIn():
                ins += 1
                moved += len(ev.mapping)
            case p.Finish():
                finished += 1
            case p.StepDone():
                used = st.counts().used
                held = st.tokens_in_used_blocks()
                entries = sum(len(s.block_table) for s in st.seqs.values())
                steps += 1
                sum_used, sum_held, sum_entries = sum_used + used, sum_held + held, sum_entries + entries
                peak_used, peak_entries = max(peak_used, used), max(peak_entries, entries)
                computed += ev.prefill_tokens + ev.decode_tokens
    n = max(1, steps)
    return LabRow(config=config, steps=steps, peak_used=peak_used, mean_used=sum_used / n,
                  slot_util=sum_held / (sum_used * bs) if sum_used else 1.0, hit_tokens=hit,
                  looked_up_tokens=looked_up, preemptions=preempt, recomputes=recompute, swap_outs=outs,
                  swap_ins=ins, swapped_blocks=moved, computed_tokens=computed, peak_entries=peak_entries,
                  mean_entries=sum_entries / n, finished=finished)
