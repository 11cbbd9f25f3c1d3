"""The history panel under the grid, at the event the other views show: the timeline, the event
log, the prefix cache as a tree and block lifetimes. The tree and the lifetimes follow the
client's event stream (app/history/follow.py)."""
from __future__ import annotations

import weakref

import numpy as np
import streamlit as st

from app.link.client import EngineClient, View
from app.history.follow import Follower
from app.derived.lifetimes import METRICS, Lifetimes
from app.ui.palette import USED, seq_color
from app.derived.prefix_events import ForestBuilder
from app.panels.prefix_tree import render
from app.panels import eventlog
from app.panels import misses
from app.panels import timeline
from app.panels import trace_download
from app.ui import travel
from kvscope_contract import protocol as p
from kvscope_contract.kinds import DEFAULT_LOG_KINDS

LOG_SCAN_EVENTS = 50_000  # the event log filters at most this many of the latest events
LOG_ROWS = 300            # and lists at most this many of those that pass
HISTORY_PANELS = ["Timeline", "Event log", "Prefix tree", "Lifetimes", misses.PANEL]
_followers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> {name: Follower}
WINDOWS = {"whole run": None, "last 50 steps": 50, "last 200 steps": 200, "last 1,000 steps": 1000}


def _follower(client: EngineClient, name: str, start) -> Follower:
    return _followers.setdefault(client, {}).setdefault(name, Follower(start))


def prefix_tree(client: EngineClient, view: View, highlight: list[int] = ()) -> None:
    start = lambda state: ForestBuilder.from_state(state, client.history.live.texts)
    builder = _follower(client, "prefix", start).at(client, view.event)
    if builder is None:
        return
    if not view.mirror.config.enable_prefix_caching:
        st.caption("Prefix caching is off in this pool: nothing is cached.")
    st.html(render(builder.forest, set(highlight), groups=len(view.mirror.config.groups)))
    st.caption("Each chip is a cached block (its id and the text of its tokens), under the block before it in "
               "its prompt; a row is a chain, branches are where prompts part. Hatched: cached with no holder "
               "(evictable); red outline: the next one evicted. Blocks cached before this page attached have "
               "no parent here.")


def lifetimes(client: EngineClient, view: View) -> None:
    lt: Lifetimes | None = _follower(client, "lifetimes", Lifetimes.from_state).at(client, view.event)
    if lt is None:
        return
    window = st.segmented_control("Window", list(WINDOWS), default="whole run", key="lifetime_window",
                                  label_visibility="collapsed") or "whole run"
    step = view.step_events[-1].step if view.step_events else 0
    since = -1 if WINDOWS[window] is None else step - WINDOWS[window]
    cols = st.columns(len(METRICS))
    for col, (metric, title) in zip(cols, METRICS.items()):
        values = lt.values(metric, since, step)
        with col:
            st.markdown(f"**{title}**")
            if not len(values):
                st.caption("none in this window")
                continue
            st.vega_lite_chart(_histogram(values), width="stretch")
            q = np.percentile(values, [50, 90])
            st.caption(f"{len(values):,} samples · median {q[0]:g} · p90 {q[1]:g} · max {values.max():,} steps")
    st.markdown("**Blocks held per request** (its sequences' blocks, shared ones once), over engine steps")
    rows = [{"request": rid, "step": s, "blocks": n} for rid, series in lt.held.items() for s, n in series
            if s > since and s <= step]
    if rows:
        colors = {rid: seq_color(client.colors.get(rid, i)) for i, rid in enumerate(lt.held)}
        st.vega_lite_chart({
            "data": {"values": rows}, "height": 180,
            "mark": {"type": "line", "interpolate": "step-after", "point": False},
            "encoding": {"x": {"field": "step", "type": "quantitative", "title": "engine step", "axis": STEP_AXIS},
                         "y": {"field": "blocks", "type": "quantitative", "title": "blocks held"},
                         "color": {"field": "request", "type": "nominal",
                                   "scale": {"domain": list(colors), "range": list(colors.values())}}}},
            width="stretch")
    else:
        st.caption("No request held blocks in this window.")
    st.caption("In engine steps. Lifetime: from the step a block leaves the free list (alloc, copy-on-write, "
               "swap-in) to the step it returns (freed, or evicted from the prefix cache); idle: from its last "
               "holder leaving to its eviction; reuse gap: between its registration or a hit and the next hit.")


STEP_AXIS = {"format": "d", "tickMinStep": 1}  # steps are whole numbers: no 151.5 ticks


def _histogram(values: np.ndarray) -> dict:
    """Bins of whole steps (at most 20), each bar labelled by the steps it counts ("0", "5–9"): a bar
    drawn from n to n + 1 read as the values between them."""
    lo, hi = int(values.min()), int(values.max())
    width = -(-(hi - lo + 1) // 20)
    edges = np.arange(lo, hi + width + 1, width)
    counts, _ = np.histogram(values, bins=edges)
    data = [{"from": int(a), "to": int(b), "steps": str(a) if b - a == 1 else f"{a}–{b - 1}", "blocks": int(c)}
            for a, b, c in zip(edges, edges[1:], counts)]
    return {"data": {"values": data}, "height": 150, "mark": {"type": "bar", "color": USED},
            "encoding": {"x": {"field": "steps", "type": "ordinal", "sort": None, "title": "steps",
                               "axis": {"labelAngle": 0}},
                         "y": {"field": "blocks", "type": "quantitative", "title": "samples",
                               "axis": {"tickMinStep": 1}},
                         "tooltip": [{"field": "steps"}, {"field": "blocks", "title": "samples"}]}}


def show_block_in_log() -> None:
    """The grid's click: the event log, filtered to the clicked block."""
    block = st.session_state["pool_grid"].get("block")
    if block is not None:
        st.session_state["log_filter"] = ("", int(block))
        st.session_state["panel_shown"] = "Event log"
        st.session_state["log_version"] = st.session_state.get("log_version", 0) + 1
        st.rerun(["panel"])


def panel(client: EngineClient, view: View, highlight: list[int] = ()) -> None:
    """The history panel: one of the timeline, the event log, the prefix tree and the lifetimes,
    at `view`'s event."""
    at_step = None if view.live else (view.step_events[-1].step if view.step_events else None)
    # one panel at a time: only the chosen one is computed and sent (a grid click remounts it on the log)
    panel = st.segmented_control("History", HISTORY_PANELS, key=f"panel_{_log_version()}",
                                 default=st.session_state.get("panel_shown", "Timeline"),
                                 label_visibility="collapsed") or "Timeline"
    st.session_state["panel_shown"] = panel
    if panel == "Event log":
        return event_log(client, view)
    if panel == "Prefix tree":
        return prefix_tree(client, view, highlight)
    if panel == "Lifetimes":
        return lifetimes(client, view)
    if panel == misses.PANEL:
        return misses.panel(client, view)
    points, markers = client.timeline(view.event)
    if len(points) < 2:
        st.caption("The timeline fills in as the engine runs steps.")
        return
    c = st.columns(2)
    total = view.mirror.config.num_device_blocks
    c[0].vega_lite_chart(timeline.blocks_chart(points, markers, at_step, total), width="stretch")
    c[1].vega_lite_chart(timeline.rates_chart(points, at_step), width="stretch")
    st.caption(f"Steps since {view.mirror.tally.since}, up to event {view.event:,}.")


def event_log(client: EngineClient, view: View) -> None:
    # A click on the grid sets the filters by remounting their widgets (a new key) with new
    # values: writing a live widget's value from Python races the other fragments' reruns.
    seq0, block0 = st.session_state.get("log_filter", ("", -1))
    if block0 >= view.mirror.config.num_device_blocks:  # a filter from before a reset to a smaller pool
        seq0, block0 = seq0, -1
    v = _log_version()
    c = st.columns([4, 2, 1])
    kinds = c[0].multiselect("Kinds", p.EVENT_KINDS, default=list(DEFAULT_LOG_KINDS), key="log_kinds")
    seq = c[1].text_input("Sequence or request", seq0, key=f"log_seq_{v}", placeholder="all, e.g. r1 or sys1-2")
    block = c[2].number_input("Block", 0, view.mirror.config.num_device_blocks - 1, None if block0 < 0 else block0,
                              key=f"log_block_{v}", placeholder="all",
                              help="Empty: every block. Clicking a block in the grid picks it.")
    block = -1 if block is None else int(block)
    st.session_state["log_filter"] = (seq, block)
    if seq.strip() or block >= 0:
        label = " · ".join(([f"sequence {seq.strip()}"] if seq.strip() else [])
                           + ([f"block {block}"] if block >= 0 else []))
        st.button(f"Filtered to {label}", icon=":material/close:", key="clear_filter", on_click=_clear_log_filter,
                  help="Show every sequence and block again")
    events = client.events_before(view.event, LOG_SCAN_EVENTS)
    df = eventlog.frame(events, set(kinds), seq.strip(), None if block < 0 else int(block), limit=LOG_ROWS)
    st.session_state["log_rows"] = df["event"].tolist()
    st.dataframe(eventlog.styled(df), key="event_log", on_select=_travel_to_selected, selection_mode="single-row",
                 hide_index=True, height=340, width="stretch",
                 column_config={"t (s)": st.column_config.NumberColumn(format="%.3f"),
                                "what happened": st.column_config.TextColumn(width="large")})
    st.caption("Newest first. Select a row to travel to that event; **Live** returns.")
    trace_download.button(client)


def _clear_log_filter() -> None:
    st.session_state["log_filter"] = ("", -1)
    st.session_state["log_version"] = _log_version() + 1


def _log_version() -> int:
    return st.session_state.get("log_version", 0)


def _travel_to_selected() -> None:
    rows = st.session_state["event_log"].selection.rows
    if rows:
        travel.go(st.session_state["log_rows"][rows[0]])
