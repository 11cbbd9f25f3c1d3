"""Time travel: which event number the session is looking at (None = live), and the bar that
moves it: a scrubber over the retained events (assets/scrubber.js), step and event buttons,
and one click back to live.

Every move is a one-shot trigger (a button, or the scrubber's trigger value), never a widget
value set from Python: the views redraw on their own timers, and a rerun request sent with a
stale widget value would otherwise read as the user moving it back.
"""
from __future__ import annotations

from functools import lru_cache

import streamlit as st

from app.data.client import EngineClient, View
from app.data.source import ASSETS
from app.ui.palette import css_vars
from kvscope_contract.kinds import KINDS, words

FRAGMENTS = ["live", "tables", "panel"]  # every view: a travel redraws them all at once


def target() -> int | None:
    return st.session_state.get("travel")


def go_live() -> None:
    """Another mode: its views start live (a lesson's stop travelled to is the lesson's)."""
    st.session_state["travel"] = None


def go(n: int | None, last: int | None = None) -> None:
    """From a widget callback: travel to event n (None, or past the last event: live) and
    redraw every view, not the whole app."""
    st.session_state["travel"] = None if n is None or (last is not None and n >= last) else n
    st.rerun(FRAGMENTS)


@lru_cache(maxsize=1)
def _scrubber():
    return st.components.v2.component(
        "kvscope_scrubber", html='<div class="scrub"><div class="track"><div class="fill"></div>'
        '<div class="ticks"></div><div class="handle"></div></div><div class="label"></div></div>',
        css=css_vars(".scrub") + (ASSETS / "scrubber.css").read_text(), js=(ASSETS / "scrubber.js").read_text())


def _scrubbed() -> None:
    n = st.session_state["travel_scrubber"].get("travel")
    if n is not None:
        go(None if n < 0 else int(n))


def bar(client: EngineClient, view: View, connected: bool) -> None:
    bounds = client.bounds()
    if bounds is None or bounds[1] - bounds[0] < 1:
        st.caption(":material/history: Time travel becomes available once events arrive.")
        return
    first, last = bounds
    n = view.event
    markers = client.markers()
    ticks = [[m.seq, KINDS[m.kind].color, f"{m.kind.replace('_', ' ')} {m.seq_id} (event {m.seq})"]
             for m in markers[-150:] if m.seq >= first]
    _scrubber()(data={"first": first, "last": last, "value": n, "live": view.live, "markers": ticks},
                key="travel_scrubber", on_travel_change=_scrubbed)
    c = st.columns(5, gap="small")
    c[0].button("Step", icon=":material/skip_previous:", key="tt_prev_step", help="End of the previous engine step",
                width="stretch", on_click=lambda: go(client.step_edge(n, False), last))
    c[1].button("Event", icon=":material/chevron_left:", key="tt_prev", help="Previous event", width="stretch",
                on_click=lambda: go(max(first, n - 1), last))
    c[2].button("Event", icon=":material/chevron_right:", key="tt_next", help="Next event", width="stretch",
                on_click=lambda: go(min(last, n + 1), last))
    c[3].button("Step", icon=":material/skip_next:", key="tt_next_step", help="End of the next engine step",
                width="stretch", on_click=lambda: go(client.step_edge(n, True), last))
    c[4].button("Live", icon=":material/radio_button_checked:", key="tt_live", width="stretch",
                type="secondary" if view.live else "primary", on_click=lambda: go(None), disabled=view.live)
    ev = view.step_events[-1] if view.step_events else None
    where = f"event **{n:,}** of {last:,}" + (f" · step {ev.step} · {ev.__struct_config__.tag}: {words(ev)}"
                                              if ev and ev.seq == n else "")
    mode = (":orange[:material/history: **Time travel**] · " if not view.live else ":green[● **Live**] · " if connected
            else ":red[● **Not connected**: the last state received] · ")
    st.caption(mode + where + (" · the engine keeps running: press **Live** to return" if not view.live else ""))
