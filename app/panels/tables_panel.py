"""The block tables panel of the live views, as data for their one element (assets/live.js):
search and sort (the element's `tables` state), the cards (app/panels/tables.py draws them),
with many sequences the list of every match (a click pins that sequence's card: the `pin`
trigger), and the finished requests."""
from __future__ import annotations

import streamlit as st

from app.link.client import View
from app.panels import tables

LIST_ROWS = 1_000  # rows of the list sent with a redraw; a search narrows the rest
CONTROLS = {"query": "", "sort": "status", "open": False, "groups": False, "tab": "tables"}
PIN = "bt_pin"  # session state: the sequence whose card is pinned on top


def controls() -> dict:
    """The session's search, order, open runs and tab (what the element last said)."""
    return st.session_state.setdefault("bt_controls", dict(CONTROLS))


def changed(key: str) -> None:
    """The element's `tables` state: the controls as the user set them."""
    value = st.session_state[key].get("tables")
    if isinstance(value, dict):
        c = controls()
        c.update({k: type(CONTROLS[k])(value[k]) for k in CONTROLS if k in value})
        if c["sort"] not in tables.SORTS:
            c["sort"] = CONTROLS["sort"]


def pinned(key: str) -> None:
    """The element's `pin` trigger: a row of the list clicked."""
    seq_id = st.session_state[key].get("pin")
    if isinstance(seq_id, str):
        st.session_state[PIN] = seq_id


def data(view: View, colors: dict[str, int], highlight: set[int], c: dict, pin: str | None) -> dict:
    """The panel's data for `view`, with the session's controls `c` and pinned sequence."""
    key = ("tables", c["query"], c["sort"])
    if key not in view.memo:
        view.memo[key] = tables.chosen(view, c["query"], c["sort"])
    seqs = view.memo[key]
    total = len(view.mirror.state.seqs)
    if pin not in view.mirror.state.seqs:
        pin = None
    few = len(seqs) <= tables.ALL_CARDS
    caption = f"{len(seqs):,} of {total:,} live sequences" + ("" if few else
              f" · the first {tables.CARDS} as cards, all in the list below (click one to pin its card)")
    columns = rows = None
    if not few:
        columns, rows = tables.LIST_COLUMNS, tables.listing(view, seqs[:LIST_ROWS])
    hybrid = len(view.mirror.config.groups) > 1  # a row per KV-cache group, or one per kind alike
    return {"controls": c, "sorts": list(tables.SORTS), "caption": caption, "pinned": pin, "hybrid": hybrid,
            "cards": tables.render(view, colors, seqs if few else seqs[:tables.CARDS], pin, c["open"], highlight,
                                   hybrid and c["groups"]),
            "columns": columns, "rows": rows, "more": max(0, len(seqs) - LIST_ROWS),
            "finished": tables.render_finished(list(view.mirror.finished), colors)}
