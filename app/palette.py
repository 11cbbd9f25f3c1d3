"""Colours shared by every view: one per sequence (by order of appearance) and one per block
state, so the grid, the tables and the charts agree. Event kinds carry their own colours
(engine/contract/kinds.py)."""
from __future__ import annotations

SEQ_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#17becf", "#edc948",
              "#ff9da7", "#9c755f", "#1b9e77", "#bcbd22", "#7570b3", "#d95f02", "#e7298a",
              "#66a61e", "#76b7b2")
FREE, CACHED, RESERVED = "#e2e8f0", "#94a3b8", "#334155"
SHARED = "#312e81"  # a block held by several sequences: a colour of its own, not its first holder's
BLOCK_STATE_COLORS = {"used": "#4e79a7", "cached": CACHED, "free": FREE, "reserved": RESERVED}


def seq_color(index: int) -> str:
    return SEQ_COLORS[index % len(SEQ_COLORS)]
