"""The event log's download button: the history this dashboard holds (live or replayed) as a
Perfetto trace (app/export/perfetto.py), made only when clicked."""
from __future__ import annotations

import streamlit as st

from kvscope_contract import protocol as p
from kvscope_contract.rebuild import with_rebuilt_prompts
from kvscope_contract.state import PoolState
from app.export.perfetto import TraceExport
from app.history.event_history import EventHistory


def take(history: EventHistory) -> tuple[PoolState, list[p.AnyEvent], dict[int, PoolState]]:
    """What the trace needs, copied (call it under the client's lock): the state at the first
    retained event, the events after it, and the state each gap (a resync) starts from."""
    start = history.at(history.first_event)
    events = history.events[history.events.bisect_left(start.last_event + 1):]
    resyncs, last = {}, start.last_event
    for ev in events:
        if ev.seq != last + 1:
            resyncs[ev.seq] = history.at(ev.seq - 1).state.clone()
        last = ev.seq
    return start.state, events, resyncs


def history_trace(start: PoolState, events: list[p.AnyEvent], resyncs: dict[int, PoolState],
                  title: str = "KVScope dashboard") -> bytes:
    if not resyncs:  # prompts without token ids rebuilt from block hashes, for the miss reasons (as `export`)
        events, _ = with_rebuilt_prompts(start, events)
    trace = TraceExport(start, title)
    for ev in events:
        if ev.seq in resyncs:
            trace.resync(resyncs[ev.seq])
        trace.feed(ev)
    return trace.serialize()


def button(client) -> None:
    """Make the trace (a click), then download it (a second click): the event log reruns on a
    timer, and a download made on the click (Streamlit's deferred data) does not survive one."""
    with client.lock:
        h = client.history
        span = (h.first_event, h.last_event) if h is not None else None
    if span is None or span[0] == span[1]:
        return
    c = st.columns([1, 3])
    # a callback: it runs before the rerun the click asks for, so a timer's rerun cannot swallow it
    c[0].button("Perfetto trace", icon=":material/timeline:", key="perfetto_make", on_click=_make, args=(client,),
                help="The events this dashboard holds, as they are now, as a Perfetto trace: requests' "
                     "phases, pool counters, copy-on-write, evictions, swaps and preemptions. Open it at "
                     "ui.perfetto.dev (docs/perfetto.md).")
    if made := st.session_state.get("perfetto_trace"):
        label, data = made
        c[1].download_button(f"Download kvscope.pftrace ({label}, {len(data) / 1024:,.0f} KiB)", data,
                             file_name="kvscope.pftrace", mime="application/octet-stream",
                             icon=":material/download:", key="perfetto_download", on_click="ignore")


def _make(client) -> None:
    with client.lock:
        taken = take(client.history)
    st.session_state["perfetto_trace"] = (f"events {taken[1][0].seq:,} to {taken[1][-1].seq:,}"
                                          if taken[1] else "no events", history_trace(*taken))
