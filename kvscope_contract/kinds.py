"""Every event kind in one registry: its words, its colour, and how the views treat it.

The grid's outlines, the timeline's and the scrubber's markers, the event log's colours and
default filter, and `engine.model.generate`'s tally all read this table; which blocks an event
touches is `touched_blocks`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvscope_contract import protocol as p


@dataclass(frozen=True)
class Kind:
    name: str             # the wire tag
    label: str            # what happened, in a few words
    color: str            # outline in the grid, marker on the timeline, colour in the log
    touch: int = 0        # drawn as a block outline in the grid; when a block saw several kinds
                          # in one step, the highest wins (0: not drawn)
    marker: bool = False  # a tick on the timeline and on the scrubber
    block: bool = False   # changes a block's ref count or hash
    noisy: bool = False   # one per token or per step: hidden from the event log by default


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("request_added", "request added", "#334155"),
    Kind("fork", "shared by a fork", "#a16207", touch=5, block=True),
    Kind("alloc", "allocated", "#16a34a", touch=3, block=True),
    Kind("prefix_hit", "prefix hit", "#2563eb", touch=4, block=True),
    Kind("cached", "registered in the prefix cache", "#64748b", block=True),
    Kind("evict", "evicted", "#dc2626", touch=6, block=True),
    Kind("cow", "copy-on-write", "#db2777", touch=9, block=True),
    Kind("free", "freed", "#64748b", touch=1, block=True),
    Kind("window_free", "left the sliding window", "#0d9488", touch=2, block=True),
    Kind("preempt", "preempted", "#b91c1c", marker=True, block=True),
    Kind("swap_out", "swapped out", "#7c3aed", touch=7, marker=True, block=True),
    Kind("swap_in", "swapped in", "#0891b2", touch=8, marker=True, block=True),
    Kind("append", "tokens appended", "#475569", noisy=True),
    Kind("status", "status changed", "#475569", noisy=True),
    Kind("finish", "finished", "#334155"),
    Kind("step", "step done", "#475569", noisy=True),
    Kind("reset", "engine reset", "#475569", marker=True),
)}
assert tuple(KINDS) == p.EVENT_KINDS, "every event kind of the protocol is registered, in order"

TOUCH_KINDS: tuple[str, ...] = tuple(sorted((k.name for k in KINDS.values() if k.touch),
                                            key=lambda n: KINDS[n].touch))
MARKER_KINDS: frozenset[str] = frozenset(k.name for k in KINDS.values() if k.marker)
BLOCK_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.block)
DEFAULT_LOG_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if not k.noisy)


def kind_of(ev: p.Event) -> str:
    return ev.__struct_config__.tag


def touched_blocks(ev: p.Event) -> tuple[list[int], list[int]]:
    """(device blocks, host blocks) that `ev` changes or names."""
    match ev:
        case p.Alloc() | p.PrefixHit() | p.Evict() | p.Free() | p.Cached() | p.WindowFree():
            return [ev.block_id], []
        case p.Fork():
            return [b for t in ev.block_tables or [ev.block_ids] for b in t if b != p.NULL_BLOCK], []
        case p.Cow():
            return [ev.src_block_id, ev.dst_block_id], []
        case p.SwapOut():
            pairs = ev.mapping + ev.shared
            return [d for d, _ in pairs], [h for _, h in pairs]
        case p.SwapIn():
            pairs = ev.mapping + ev.shared
            return [d for _, d in pairs], [h for h, _ in pairs]
    return [], []
