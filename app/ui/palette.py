"""Colours shared by every view: one per sequence (by order of appearance) and one per block
state, so the grid, the tables and the charts agree. Event kinds carry their own colours
(kvscope_contract/kinds.py)."""
from __future__ import annotations

from kvscope_contract.state import STATE_NAMES

SEQ_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#17becf", "#edc948",
              "#ff9da7", "#9c755f", "#1b9e77", "#bcbd22", "#7570b3", "#d95f02", "#e7298a",
              "#66a61e", "#76b7b2")
USED = SEQ_COLORS[0]  # a used block when sequences are not told apart; the bar charts' one colour
FREE, CACHED, RESERVED = "#e2e8f0", "#94a3b8", "#334155"
SHARED = "#312e81"  # a block held by several sequences: a colour of its own, not its first holder's
BLOCK_STATE_COLORS = {"used": USED, "cached": CACHED, "free": FREE, "reserved": RESERVED, "shared": SHARED}
ACCENT = "#d97706"  # where you are in time: the travel cursor and scrubber, the past badge, a pinned sequence
LIT = "#f59e0b"     # what the pointer is on, lit in another view (a table chip, a prefix-tree node)
RESERVED_BAR = SEQ_COLORS[3]  # "what paging saves": the contiguous reservation, beside paging's USED
LIVE = "#16a34a"    # the present: the header's Live, the scrubber at the newest event, tokens/s
INK = "#0f172a"     # drawn over blocks: the rings of a key event's blocks, a shared table chip's outline
UNKNOWN_HASH = "#0f766e"  # a prefix-tree node known by its hash only (a KV-event stream without tokens)
STATUS_COLORS = {"waiting": ("#fef3c7", "#92400e"), "running": ("#dcfce7", "#166534"),  # a status chip:
                 "swapped": ("#ede9fe", "#5b21b6"), "other": (FREE, RESERVED)}         # (background, text)


SLIDING_COLORS = ("#0f766e", "#0d9488", "#14b8a6", "#2dd4bf", "#5eead4", "#99f6e4", "#115e59", "#134e4a")
FULL_COLORS = ("#7c3aed", "#a855f7", "#6d28d9", "#c084fc")


def group_colors(groups) -> list[str]:
    """A colour per KV-cache group (kvscope_contract.protocol.KVGroup): sliding-window groups in
    shades of teal, full-attention groups in violet, so the grid's "colour by group" tells the
    kinds apart first."""
    out, n = [], {True: 0, False: 0}
    for g in groups:
        sliding = g.window is not None
        ramp = SLIDING_COLORS if sliding else FULL_COLORS
        out.append(ramp[n[sliding] % len(ramp)])
        n[sliding] += 1
    return out


def css_vars(selector: str) -> str:
    """A CSS rule giving `selector` and its descendants the palette's colours as variables
    (`--kv-accent`, `--kv-lit`, `--kv-live`, `--kv-ink`): the stylesheets in assets/ use them and
    hold no copy."""
    return f"{selector} {{ --kv-accent: {ACCENT}; --kv-lit: {LIT}; --kv-live: {LIVE}; --kv-ink: {INK}; }}\n"


def block_color(state: int) -> str:
    """A device block's colour by its state code (kvscope_contract.state) when sequences are not
    told apart: the grid's rule (grid.js gets these colours in app/panels/grid.py's STYLE)."""
    return BLOCK_STATE_COLORS[STATE_NAMES[state]]


def seq_color(index: int) -> str:
    return SEQ_COLORS[index % len(SEQ_COLORS)]
