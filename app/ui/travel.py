"""Time travel: which event number the session is looking at (None = live), and the bar that
moves it: a scrubber over the retained events with ticks at the timeline's markers, step and
event buttons, and one click back to live. The bar is drawn by the live views' one element
(assets/live.js) from the redraw's data; its moves come back as that element's `travel` trigger.

Every move is a one-shot trigger, never a widget value set from Python: the views redraw on
their own timers, and a rerun request sent with a stale widget value would otherwise read as
the user moving it back.
"""
from __future__ import annotations

from html import escape
from typing import Callable

import streamlit as st

from app.link.client import EngineClient, Redraw
from app.ui.icons import icon
from kvscope_contract.kinds import KINDS, words

FRAGMENTS = ["live", "panel"]  # every view: a travel redraws them all at once
MAX_TICKS = 150                # markers drawn on the scrubber (the newest)
MOVES = ("prev_step", "prev", "next", "next_step", "live")


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


def destination(move: str, at: int, first: int, last: int, step_edge: Callable[[int, bool], int]) -> int | None:
    """Where a button of the bar goes from event `at` (None: live)."""
    if move == "live":
        return None
    n = {"prev_step": lambda: step_edge(at, False), "prev": lambda: at - 1, "next": lambda: at + 1,
         "next_step": lambda: step_edge(at, True)}[move]()
    n = max(first, n)
    return None if n >= last else n


def moved(client: EngineClient, key: str) -> None:
    """The element's `travel` trigger: {"to": n} from the scrubber (-1: live), or {"move": one
    of MOVES, "at": the event it showed} from a button."""
    value = st.session_state[key].get("travel")
    if not isinstance(value, dict) or (bounds := client.bounds()) is None:
        return
    first, last = bounds
    if "to" in value:
        n = int(value["to"])
        go(None if n < 0 else max(first, n), last)
    elif value.get("move") in MOVES:
        go(destination(value["move"], int(value.get("at", last)), first, last, client.step_edge))


def bar(r: Redraw, connected: bool, before_restart: bool = False) -> dict | None:
    """What the bar draws for this redraw (None: too few events to travel yet); `before_restart`:
    the history of the engine before a restart, where nothing runs on."""
    first, last, n, view = r.first, r.last, r.event, r.view
    if last - first < 1:
        return None
    ticks = [[m.seq, KINDS[m.kind].color, f"{m.kind.replace('_', ' ')} {m.seq_id} (event {m.seq:,})"]
             for m in r.markers[-MAX_TICKS:] if m.seq >= first]
    ev = view.step_events[-1] if view.step_events else None
    where = f"event <b>{n:,}</b> of {last:,}" + (
        f" · step {ev.step:,} · {ev.__struct_config__.tag}: {escape(words(ev))}" if ev and ev.seq == n else "")
    mode = ('<span class="past">' + icon("history") + '<b>Time travel</b></span> · ' if not view.live else
            '<span class="dead">● <b>Before the restart</b>: its last event</span> · ' if before_restart else
            '<span class="live">● <b>Live</b></span> · ' if connected else
            '<span class="dead">● <b>Not connected</b>: the last state received</span> · ')
    back = ("" if view.live else " · press <b>Live</b> for its last event" if before_restart or not connected
            else " · the engine keeps running: press <b>Live</b> to return")
    return {"first": first, "last": last, "value": n, "live": view.live, "markers": ticks,
            "caption": mode + where + back}
