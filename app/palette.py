"""Colours shared by every view: one per sequence (by order of appearance), one per block
state, one per kind of allocator decision, so the grid, the tables and the charts agree."""
from __future__ import annotations

SEQ_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#17becf", "#edc948",
              "#ff9da7", "#9c755f", "#1b9e77", "#bcbd22", "#7570b3", "#d95f02", "#e7298a",
              "#66a61e", "#76b7b2")
FREE, CACHED = "#e2e8f0", "#94a3b8"
STATE_COLORS = {"used": "#4e79a7", "cached": CACHED, "free": FREE}

# What happened to a block in the latest step; the higher, the more it matters when several did.
TOUCH_KINDS = ("free", "alloc", "hit", "evict", "swap_out", "swap_in", "cow")
TOUCH_COLORS = {"alloc": "#16a34a", "hit": "#2563eb", "cow": "#db2777", "evict": "#dc2626",
                "swap_out": "#7c3aed", "swap_in": "#0891b2", "free": "#64748b"}
TOUCH_LABELS = {"alloc": "allocated", "hit": "prefix hit", "cow": "copy-on-write",
                "evict": "evicted", "swap_out": "swapped out", "swap_in": "swapped in",
                "free": "freed"}
MARKER_COLORS = {"preempt": "#dc2626", "swap_out": "#7c3aed", "swap_in": "#0891b2", "reset": "#475569"}


def seq_color(index: int) -> str:
    return SEQ_COLORS[index % len(SEQ_COLORS)]
