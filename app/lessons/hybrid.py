"""What a lesson says about a hybrid pool (sliding-window and full-attention KV-cache groups): the
stops that show an admission into every group's table and a window that moved, and the
placeholders their captions fill from the run (the groups, the blocks the windows freed, a hit per
group, what the windows save against full attention on every layer). On a one-group pool the
placeholders say so rather than guess."""
from __future__ import annotations

import math

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.kinds import touched_blocks
from kvscope_contract.kv_groups import describe
from kvscope_contract.snapshot_codec import hash_value
from kvscope_contract.state import NULL
from app.derived.key_events import block_ranges
from app.derived.words import plural

PLACEHOLDERS = {
    "groups": "the pool's KV-cache groups in words", "ngroups": "how many KV-cache groups",
    "sliding": "how many of them are sliding-window groups", "window": "the sliding window, in tokens",
    "group_layers": "layers per group (what one block of any group holds)",
    "window_blocks": "blocks a sliding-window group reads before a position: ⌈(window − 1) / block size⌉",
    "freed": "blocks that left a window in this step", "full_table": "{seq}'s full-attention table: its blocks",
    "sliding_held": "blocks {seq} holds in each sliding-window group",
    "full_everywhere": "blocks full attention on every layer would hold", "full_everywhere_mib": "their MiB",
    "window_saved": "blocks the windows save against it", "window_saved_mib": "their MiB",
    "window_saved_pct": "the share saved", "hit_full": "blocks {seq} hit in the full-attention group this step",
    "hit_sliding": "blocks {seq} hit in each sliding-window group this step",
    "hit_from": "the first logical block a sliding-window group hit",
    "full_only": "blocks of {seq}'s prompt the full-attention group had cached and the sliding-window groups not",
}


def focus(kind: str, events: list[p.AnyEvent], step_events: list[p.AnyEvent]) -> tuple[list, list[int], str]:
    """(events, blocks, what) of a stop at an admission (`status`) or a window that moved (`window_free`)."""
    if kind == "window_free":
        blocks = [e.block_id for e in events]
        who = list(dict.fromkeys(e.seq_id for e in events))
        return events, blocks, (f"{plural(len(blocks), 'block')} left the sliding window of {', '.join(who)} "
                                 f"({block_ranges(blocks)}): freed, their table entries now empty")
    admitted = [e for e in events if e.status == "running"] or events
    who = {e.seq_id for e in admitted}
    blocks = list(dict.fromkeys(b for e in step_events if isinstance(e, (p.Alloc, p.PrefixHit)) and e.seq_id in who
                                for b in touched_blocks(e)[0]))
    return admitted, blocks, (f"{', '.join(sorted(who))} admitted: {plural(len(blocks), 'block')} "
                              f"({block_ranges(blocks)}) in its tables")


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB"


def context(fx, mirror, usage: dict, seq) -> dict[str, str]:
    """The hybrid placeholders' values at a stop (`usage`: the mirror's usage numbers, `seq`: the
    sequence the stop is about, or None)."""
    pool, cfg = mirror.state, mirror.config
    groups, bs, bpb = cfg.groups, cfg.block_size, cfg.bytes_per_block or 0
    sliding = [g for g, x in enumerate(groups) if x.window is not None]
    full = [g for g, x in enumerate(groups) if x.window is None]
    window = groups[sliding[0]].window if sliding else None
    out = {"groups": describe(cfg.kv_groups), "ngroups": str(len(groups)), "sliding": str(len(sliding)),
           "window": f"{window:,}" if window else "none", "group_layers": str(len(groups[0].layers) or "?"),
           "window_blocks": str(math.ceil((window - 1) / bs)) if window else "none"}
    out["freed"] = str(sum(isinstance(e, p.WindowFree) for e in fx.step_events))
    tables = seq.block_tables if seq is not None else []
    out["full_table"] = str(len(tables[full[0]])) if seq is not None and full else "?"
    out["sliding_held"] = str(len(tables[sliding[0]]) - tables[sliding[0]].count(NULL)) if seq and sliding else "?"
    everywhere, used = usage["full_everywhere"], usage["used"]
    out |= {"full_everywhere": f"{everywhere:,}", "full_everywhere_mib": _mib(everywhere * bpb),
            "window_saved": f"{everywhere - used:,}", "window_saved_mib": _mib((everywhere - used) * bpb),
            "window_saved_pct": f"{(everywhere - used) / everywhere:.0%}" if everywhere else "0%"}
    sid = seq.seq_id if seq is not None else None
    hits = [e for e in fx.step_events if isinstance(e, p.PrefixHit) and e.seq_id == sid]
    first = [e.logical_index for e in hits if sliding and e.kv_group == sliding[0]]
    out |= {"hit_full": str(sum(e.kv_group in full for e in hits)),
            "hit_sliding": str(len(first)), "hit_from": str(min(first)) if first else "none",
            "full_only": str(_full_only(fx.step_events, pool, sid, sliding, full))}
    return out


def _full_only(step_events, pool, sid, sliding: list[int], full: list[int]) -> int:
    """Blocks `sid` registered in a sliding-window group in this step whose content (hash) the
    full-attention group had cached already: a hit the full group alone could have served."""
    if not sliding or not full:
        return 0
    held = set(pool.hash64[pool.has_hash & np.isin(pool.kv_group, full)].tolist())
    mine = [e.hash for e in step_events if isinstance(e, p.Cached) and e.seq_id == sid and e.kv_group == sliding[0]]
    return sum(hash_value(h)[0] in held for h in mine)
