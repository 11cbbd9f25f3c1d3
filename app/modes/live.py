"""The live pool page that Explore and Lessons draw: a few fragments that redraw on their own
timers from the shared client's state. The live views (status, metrics, what paging saves, time
travel, the pool grid) redraw together, so their numbers always describe the same event; the
block tables and the timeline or event log follow the event the live views last drew (or the one
travelled to). An exception in one panel is shown in that panel and never removes the others.
Also the pages before a pool exists: the engine loading, the client connecting.
"""
from __future__ import annotations

import time
from typing import Callable

import streamlit as st

from app.ui import stale, travel
from app.modes import lessons_view
from app.panels import grid, header, history_panels, misses, tables
from app.data.client import EngineClient, View
from app.ui.commands import show_replies
from app.ui.connection import Hosted, resolve, restart
from app.data.key_events import explain
from app.data.source import Source

# Live views redraw when the browser has drawn the last grid frame and asks for the next (app/panels/grid.py):
# this long after it asked for the last one, or once it has drawn it when that takes longer; 80 ms,
# so that round trips that vary still give 10 per second.
REFRESH = {"10 per second": 0.08, "5 per second": 0.2, "2 per second": 0.5}
HEARTBEAT_S = 2.0  # the live views redraw at least this often, should the browser not ask


def mode() -> str:
    return st.session_state.get("mode") or "Explore"


def fragment_of(draw: Callable[[EngineClient, Source, Hosted | None], None]) -> Callable[[Source], None]:
    """A fragment body: it finds the source's client afresh on every run (the engine may have
    been restarted meanwhile, by any tab: then the whole page is drawn again), and draws its
    own exception in its own place instead of ending the run."""
    def run(source: Source) -> None:
        if st.session_state.get("source", source) != source:
            st.rerun()  # the source changed under this fragment (a Connect click can ride its rerun)
        stale.redraw_if_stale()
        client, hosted = pick(source)
        if client is None or client.view() is None:
            st.rerun()  # starting again: the whole page shows the progress
        try:
            draw(client, source, hosted)
        except Exception as e:  # st.rerun and st.stop are BaseExceptions: they pass
            st.error(f"This panel failed to draw: {type(e).__name__}: {e}")
            st.exception(e)
    run.__name__ = draw.__name__
    return run


BROWSE_BEFORE = "browse_before_restart"  # session state: draw the history of the engine before its restart


def pick(source: Source) -> tuple[EngineClient | None, Hosted | None]:
    """The client the page draws: the source's, or (asked for, after a restart) the one of the
    process before, whose history stays browsable."""
    client, hosted = resolve(source)
    if st.session_state.get(BROWSE_BEFORE) and hosted is not None and hosted.previous is not None:
        return hosted.previous, hosted
    return client, hosted


def before_restart(hosted: Hosted | None, client: EngineClient) -> None:
    """After a restart: a way to the history before it, and back."""
    old = hosted.previous if hosted is not None else None
    if old is None:
        return
    if client is old:
        first, last = old.bounds() or (0, 0)
        c = st.columns([4, 1], vertical_alignment="center")
        c[0].warning(f"**The history before the restart** (events {first:,}–{last:,}): the engine has restarted "
                     "since; nothing here is live.", icon=":material/history:")
        if c[1].button("Back to the engine", key="browse_live", type="primary", width="stretch"):
            st.session_state.update({BROWSE_BEFORE: False, "travel": None, "frame": None})
            st.rerun(scope="app")
    elif st.button("Browse the history before the restart", key="browse_before", icon=":material/history:",
                   help="The engine that died: its events up to then, with time travel"):
        st.session_state.update({BROWSE_BEFORE: True, "travel": None, "frame": None})
        st.rerun(scope="app")


def live_view(client: EngineClient) -> View | None:
    """What the live views draw: the latest event, or the one travelled to."""
    return client.view(travel.target())


def frame_view(client: EngineClient) -> View | None:
    """What the other panels draw: the event the live views last drew (or travelled to)."""
    n = travel.target()
    if n is not None:
        return client.view(n)
    frame = st.session_state.get("frame")
    return client.view(frame[1], live=True) if frame and frame[0] == client.epoch else client.view()


# ---------------------------------------------------------------------------------- fragments
def live_views(client: EngineClient, source: Source, hosted: Hosted | None) -> None:
    show_replies(client)
    header.status_line(client, source, hosted)
    before_restart(hosted, client)
    dead = hosted is not None and hosted.process.died and client is not hosted.previous
    if dead:
        died(source, hosted)
    connected = client.status.state == "connected" and not dead
    view = live_view(client)
    if view is None:
        return
    st.session_state["frame"] = (view.epoch, view.event)
    lesson = lessons_view.stage(client) if mode() == "Lessons" else None  # its caption, and its blocks
    key = stopped_at(client, view) if lesson is None else None
    if key:
        at = client.loop.stopped_at
        where = f"**Paused at event {view.event:,}**" + (
            f", the end of the step of the key event ({at:,})" if view.event != at else ", the key event")
        st.info(f"{where} · {key.text}", icon=":material/fast_forward:")
    ringed = misses.ring(view) if lesson is None and not key else None
    if ringed:
        st.info(f"**Event {view.event:,}** · {ringed[1]}", icon=":material/troubleshoot:")
    header.metrics(view, client)
    travel.bar(client, view, connected)
    grid.show(view, client.colors, interval_s=REFRESH[st.session_state.get("refresh", "10 per second")],
              on_block=history_panels.show_block_in_log, extra={
                  "connected": connected,
                  "highlight": lesson if lesson is not None else key.blocks if key else ringed[0] if ringed else []})
    # in the same redraw as the header (their numbers agree), below the grid: the card comes and
    # goes with the sequences, and the grid must not move under the pointer when it does
    header.reservation_card(view)


def stopped_at(client: EngineClient, view: View):
    """The key event a run-to-next-key-event stopped at, explained, while the engine waits there."""
    at = client.loop.stopped_at
    if not client.loop.paused or at is None or not view.live and view.event < at:
        return None
    h = client.history
    if h is None or h.segment_start(view.event + 1) >= at or at > view.event:  # a reset (or clean slate) since
        return None
    if "key" not in view.memo:
        h = client.history
        view.memo["key"] = explain(h.step_events(at), at, view.mirror.state) if h else None
    return view.memo["key"]


def died(source: Source, hosted: Hosted) -> None:
    proc = hosted.process
    with st.container(border=True):
        st.error(f"**The {source.label} died** ({proc.exit_reason()}). Its history up to then stays browsable "
                 "below, and after a restart too (*Browse the history before the restart*); Restart starts it "
                 "again with the pool config and pace it last had.",
                 icon=":material/heart_broken:")
        c = st.columns([1, 4])
        c[0].button("Restart engine", type="primary", key="restart_dead", on_click=restart, args=(source, proc))
        with c[1].expander("Its last lines"):
            st.code("\n".join(proc.tail(30)) or "(no output)")


def block_tables(client: EngineClient, source: Source, hosted: Hosted | None) -> None:
    view = frame_view(client)
    if view is None:
        return
    live_tab, done_tab = st.tabs(["Block tables", "Finished requests"])
    lit = lessons_view.highlight() if mode() == "Lessons" else []
    with live_tab:
        tables.panel(view, client.colors, highlight=set(lit))
    with done_tab, st.container(height=640, border=False):
        st.html(tables.render_finished(list(view.mirror.finished), client.colors))


def timeline_or_log(client: EngineClient, source: Source, hosted: Hosted | None) -> None:
    view = frame_view(client)
    if view is not None:
        history_panels.panel(client, view, lessons_view.highlight() if mode() == "Lessons" else [])


# ------------------------------------------------------------------------------ the page
def loading(source: Source, hosted: Hosted) -> None:
    proc = hosted.process
    st.title("KVScope")
    if proc.state == "exited":
        st.error(f"The {source.label} stopped before it was ready ({proc.exit_reason()}). Its last lines:")
        st.code("\n".join(proc.tail(30)) or "(no output)")
        st.button("Retry", type="primary", on_click=restart, args=(source, proc))
        return
    if proc.refused:  # vLLM serves on, but the plugin cannot show its pool: say why, not "starting"
        st.error(f"**KVScope cannot show this vLLM's pool.** {proc.refused}", icon=":material/visibility_off:")
        with st.expander("vLLM's last lines"):
            st.code("\n".join(proc.tail(30)) or "(no output)")
        return

    @st.fragment(run_every=0.5)
    def progress() -> None:
        if proc.state != "starting" or proc.refused:
            st.rerun()
        with st.status(f"Starting the {source.label}: {time.time() - proc.started:.0f} s", expanded=True,
                       state="running"):
            st.caption(f"`{proc.command}` · loading the model takes a few seconds; the very first run "
                       "converts the bundled GGUF once (about 20 s more)")
            st.code("\n".join(proc.tail(12)) or "starting Python…")

    progress()


def connecting(client: EngineClient, source: Source, hosted: Hosted | None) -> None:
    st.title("KVScope")

    @st.fragment(run_every=0.5)
    def wait() -> None:
        if client.view() is not None or (hosted is not None and hosted.process.died):
            st.rerun()
        header.status_line(client, source, hosted)
        st.info("Waiting for the engine's first snapshot. The client reconnects on its own; "
                "check the URL and token in the sidebar if this lasts.")

    wait()


def page(source: Source) -> None:
    """The pool grid and the live views beside the block tables, the history panel below."""
    left, right = st.columns([3, 2], gap="medium")
    with left:
        # run by the grid: the browser asks for the next frame when it has drawn the last
        st.fragment(fragment_of(live_views), run_every=HEARTBEAT_S, key="live")(source)
    with right:
        st.fragment(fragment_of(block_tables), run_every=0.5, key="tables")(source)
    st.fragment(fragment_of(timeline_or_log), run_every=2.0, key="panel")(source)
