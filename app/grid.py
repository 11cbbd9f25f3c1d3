"""The pool grid: the state of every device and host block, packed into a few base64 arrays
and drawn on a canvas by a components.v2 component (assets/grid.js) several times a second.

Per device block: state (free/cached/used/shared/reserved), ref count, latest-step touch, tokens held,
owner (index into `seqs`, 0 = none) and the first 32 bits of the prefix hash.
"""
from __future__ import annotations

import base64
from functools import lru_cache
from pathlib import Path

import numpy as np
import streamlit as st

from engine.contract import protocol as p
from engine.contract.kinds import KINDS, TOUCH_KINDS, kind_of, touched_blocks
from engine.contract.state import table_entries
from app.client import View
from app.palette import CACHED, FREE, RESERVED, SEQ_COLORS

ASSETS = Path(__file__).resolve().parent.parent / "assets"
_CODE = {k: i + 1 for i, k in enumerate(TOUCH_KINDS)}  # touch code sent to the canvas: 1 + index


def touched(events: list[p.AnyEvent]) -> tuple[dict[int, int], dict[int, int]]:
    """Device and host blocks touched by `events`: block -> touch code (1 + TOUCH_KINDS index),
    the most telling kind winning when a block saw several."""
    dev: dict[int, int] = {}
    host: dict[int, int] = {}
    for ev in events:
        code = _CODE.get(kind_of(ev))
        if code is None:
            continue
        for where, blocks in zip((dev, host), touched_blocks(ev)):
            for b in blocks:
                if where.get(b, 0) < code:
                    where[b] = code
    return dev, host


@lru_cache(maxsize=65536)
def _hash32(h: str) -> int:
    return int(h[:8], 16)


def _b64(*arrays: np.ndarray) -> str:
    return base64.b64encode(b"".join(a.tobytes() for a in arrays)).decode()


def payload(view: View, colors: dict[str, int]) -> dict:
    """Everything the canvas needs to draw `view`, as compact JSON."""
    st_, cfg = view.mirror.state, view.mirror.config
    n, m = len(st_.ref_counts), len(st_.host_owner)
    seqs = list(st_.seqs.values())
    index = {s.seq_id: i + 1 for i, s in enumerate(seqs)}
    ref = np.asarray(st_.ref_counts, dtype=np.int64)
    state = st_.block_states()
    hash32 = np.fromiter((_hash32(h) if h else 0 for h in st_.hashes), np.uint32, n)
    dev_tokens, host_tokens = st_.block_tokens()
    flat, holder, _ = table_entries([s.block_table for s in seqs], [s.num_tokens for s in seqs], cfg.block_size)
    first = np.full(n, len(seqs) + 1)
    np.minimum.at(first, flat, holder)
    owner = np.where(first > len(seqs), 0, first).astype(np.uint16)
    shared: dict[int, list[int]] = {}
    many = ref[flat] >= 2
    for b, i in zip(flat[many].tolist(), holder[many].tolist()):
        shared.setdefault(b, []).append(i)
    dev_touch, host_touch = touched(view.step_events)
    touch = np.zeros(n, np.uint8)
    if dev_touch:
        touch[list(dev_touch)] = list(dev_touch.values())
    host_touch_arr = np.zeros(m, np.uint8)
    if host_touch:
        host_touch_arr[list(host_touch)] = list(host_touch.values())
    host_owner = np.fromiter((index.get(o, 0) if o else 0 for o in st_.host_owner), np.uint16, m)
    kinds = {}
    for code in list(dev_touch.values()) + list(host_touch.values()):
        kinds[TOUCH_KINDS[code - 1]] = kinds.get(TOUCH_KINDS[code - 1], 0) + 1
    last = view.step_events[-1] if view.step_events else None
    return {
        "seq": view.event, "live": view.live, "step": last.step if last else 0,
        "n": n, "m": m, "bs": cfg.block_size,
        # device: owner u16 | tokens u16 | hash u32 | state u8 | ref u8 | touch u8 (aligned)
        "dev": _b64(owner, np.asarray(dev_tokens, np.uint16), hash32, state,
                    np.minimum(ref, 255).astype(np.uint8), touch),
        # host: owner u16 | tokens u16 | touch u8
        "host": _b64(host_owner, np.asarray(host_tokens, np.uint16), host_touch_arr),
        "seqs": [[s.seq_id, colors.get(s.seq_id, i) % len(SEQ_COLORS), s.status]
                 for i, s in enumerate(seqs)],
        "shared": {str(b): o for b, o in shared.items()},
        "touched": kinds,
        "counts": st_.counts()._asdict(),
    }


STYLE = {"palette": list(SEQ_COLORS), "free": FREE, "cached": CACHED, "reserved": RESERVED,
         "touch": [KINDS[k].color for k in TOUCH_KINDS], "touchKinds": list(TOUCH_KINDS),
         "touchLabels": [KINDS[k].label for k in TOUCH_KINDS]}


@lru_cache(maxsize=1)
def _component():
    return st.components.v2.component(
        "kvscope_grid", html='<div class="kv"></div>',
        css=(ASSETS / "grid.css").read_text(), js=(ASSETS / "grid.js").read_text())


def draw(data: dict, key: str = "pool_grid", on_block=None):
    """Mount (or update) the grid; `data` is `payload(...)`. `on_block` runs when a block is
    clicked, with its id in st.session_state[key]["block"]."""
    return _component()(data={**data, "style": STYLE}, key=key, on_block_change=on_block or (lambda: None))
