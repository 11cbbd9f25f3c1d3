"""Two more views of the history panel: the prefix cache as a tree, and block lifetimes.
Each follows the client's event stream (app/follow.py), at the event the other views show."""
from __future__ import annotations

import weakref

import numpy as np
import streamlit as st

from app.client import EngineClient, View
from app.follow import Follower
from app.lifetimes import METRICS, Lifetimes
from app.palette import USED, seq_color
from app.prefix_events import ForestBuilder
from app.prefix_tree import render

_followers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> {name: Follower}
WINDOWS = {"whole run": None, "last 50 steps": 50, "last 200 steps": 200, "last 1,000 steps": 1000}


def _follower(client: EngineClient, name: str, start) -> Follower:
    return _followers.setdefault(client, {}).setdefault(name, Follower(start))


def prefix_tree(client: EngineClient, view: View, highlight: list[int] = ()) -> None:
    start = lambda state: ForestBuilder.from_state(state, client.history.live.texts)  # noqa: E731
    builder = _follower(client, "prefix", start).at(client, view.event)
    if builder is None:
        return
    if not view.mirror.config.enable_prefix_caching:
        st.caption("Prefix caching is off in this pool: nothing is cached.")
    st.html(render(builder.forest, set(highlight)))
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
            "encoding": {"x": {"field": "step", "type": "quantitative", "title": "engine step"},
                         "y": {"field": "blocks", "type": "quantitative", "title": "blocks held"},
                         "color": {"field": "request", "type": "nominal",
                                   "scale": {"domain": list(colors), "range": list(colors.values())}}}},
            width="stretch")
    else:
        st.caption("No request held blocks in this window.")
    st.caption("In engine steps. Lifetime: from the step a block leaves the free list (alloc, copy-on-write, "
               "swap-in) to the step it returns (freed, or evicted from the prefix cache); idle: from its last "
               "holder leaving to its eviction; reuse gap: between its registration or a hit and the next hit.")


def _histogram(values: np.ndarray) -> dict:
    counts, edges = np.histogram(values, bins=min(20, max(1, int(values.max()) - int(values.min()) + 1)))
    data = [{"from": float(a), "to": float(b), "blocks": int(c)} for a, b, c in zip(edges, edges[1:], counts)]
    return {"data": {"values": data}, "height": 150, "mark": {"type": "bar", "color": USED},
            "encoding": {"x": {"field": "from", "type": "quantitative", "bin": {"binned": True}, "title": "steps"},
                         "x2": {"field": "to"},
                         "y": {"field": "blocks", "type": "quantitative", "title": "samples"},
                         "tooltip": [{"field": "from"}, {"field": "to"}, {"field": "blocks"}]}}
