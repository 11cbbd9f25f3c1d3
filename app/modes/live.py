"""The live pool page that Explore and Lessons draw: two fragments that redraw on their own
timers from the shared client's state. The live views (status, metrics, time travel, the pool
grid, what paging saves, the block tables) are one redraw: one Redraw read from the client in
one instant, handed to every panel, and drawn by the browser as one element in one step
(app/panels/grid.py), so their numbers always describe the same event. The history panel (the
timeline, the event log, ...) follows the event the live views last drew (or the one travelled
to) on a slower timer, and names it. An exception in one panel is shown in that panel and never
removes the others. Also the pages before a pool exists: the engine loading, the client connecting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from html import escape
from typing import Callable

import streamlit as st

from app.modes import lessons_view, trace_play_view
from app.panels import grid, header, history_panels, lane, misses, tables_panel
from app.ui import icons, roles, stale, travel
from app.ui.icons import icon
from app.link.client import EngineClient, Redraw, View
from app.history.mirror import Tally
from app.ui.commands import show_replies
from app.ui.connection import Hosted, resolve, restart
from app.derived.key_events import explain
from app.link.source import Source

# Live views redraw when the browser holds the last grid frame and asks for the next (app/panels/grid.py):
# this long after it asked for the last one, or once that frame came when it took longer; 70 ms,
# so that round trips and timers that vary still give 10 per second.
REFRESH = {"10 per second": 0.07, "5 per second": 0.2, "2 per second": 0.5}
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
        if client is None or client.bounds() is None:
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
            st.session_state.update({BROWSE_BEFORE: False, "travel": None, REDRAW: None})
            st.rerun(scope="app")
    elif st.button("Browse the history before the restart", key="browse_before", icon=":material/history:",
                   help="The engine that died: its events up to then, with time travel"):
        st.session_state.update({BROWSE_BEFORE: True, "travel": None, REDRAW: None})
        st.rerun(scope="app")


REDRAW = "redraw"  # session state: the Drawn the live views last drew, by a rerun or their lane
IN_LESSON = "in_lesson"  # session state: (the client, the event) the live views last drew in Lessons


@dataclass(eq=False)
class Drawn:
    """What the live views last drew: updated in place by their lane too (app/panels/lane.py)."""
    client: EngineClient | None = None
    redraw: Redraw | None = None


def last_redraw(client: EngineClient) -> Redraw | None:
    """The redraw the live views last drew from `client` (None before the first)."""
    held = st.session_state.get(REDRAW)
    return held.redraw if held and held.client is client else None


def current_view(client: EngineClient) -> View | None:
    """The state the page shows: the live views' last redraw's, or the event travelled to."""
    n = travel.target()
    r = last_redraw(client)
    if r is not None and (r.view.live and n is None or not r.view.live and n == r.event):
        return r.view
    return client.view(n)


# ---------------------------------------------------------------------------------- fragments
def live_views(client: EngineClient, source: Source, hosted: Hosted | None) -> None:
    prof = grid.Profile()
    show_replies(client)
    before_restart(hosted, client)
    dead = hosted is not None and hosted.process.died and client is not hosted.previous
    if dead:
        died(source, hosted)
    if mode() == "Lessons":
        lessons_view.drive(client)  # before the redraw: a lesson's run reads (and commands) the client
    # every panel below draws this, and nothing else of the client
    r = prof.timed("view", lambda: client.redraw(travel.target()))
    if r is None:
        return
    drawn_now = st.session_state[REDRAW] = Drawn(client, r)
    if mode() == "Lessons":
        st.session_state[IN_LESSON] = (client, r.event)
    connected = r.status.state == "connected" and not dead
    old = hosted is not None and client is hosted.previous  # the history before a restart
    lesson = lessons_view.stage() if mode() == "Lessons" else None  # its caption, and its blocks
    key = stopped_at(client, r) if lesson is None else None
    ringed = misses.ring(r.view) if lesson is None and not key else None  # an eviction the miss panel travelled to
    lit = set(lessons_view.highlight() if mode() == "Lessons" else [])
    tables = tables_panel.controls(), st.session_state.get(tables_panel.PIN)
    attached = own_tally(client, r)
    addresses = roles.may_drive()  # read here, in the session: the lane composes off it
    panels = prof.timed("panels", lambda: drawn(panels_of(r, source, hosted, attached, connected, old,
                                                         banner(r, key, ringed), lit, tables, addresses)))
    on = {"block": history_panels.show_block_in_log, "travel": lambda: travel.moved(client, GRID),
          "tables": lambda: tables_panel.changed(GRID), "pin": lambda: tables_panel.pinned(GRID),
          "why": misses.open_panel}
    el = grid.element(GRID)
    page_mode, pending = mode(), st.session_state["pending"]
    with el.lock:  # from here on the lane redraws as this rerun would, or not at all
        el.gen += 1
        el.interval_ms = round(REFRESH[st.session_state.get("refresh", "10 per second")] * 1000)
        lane_may = may_lane(r, client, hosted, page_mode, pending)
        el.compose_lane = lane_composer(el, client, source, hosted, drawn_now, st.session_state[ATTACHED], tables,
                                        page_mode, pending, addresses) if lane_may else None
    grid.show(r.view, r.colors, key=GRID, panels=panels, on=on, prof=prof, extra={
        "connected": connected, "lane": lane.address(el),
        "highlight": lesson if lesson is not None else key.blocks if key else ringed[0] if ringed else []})


def panels_of(r: Redraw, source: Source, hosted: Hosted | None, tally: Tally, connected: bool, old: bool,
              banner_html: str, lit: set[int], tables: tuple[dict, str | None],
              addresses: bool) -> dict[str, Callable[[], object]]:
    """The live views' panels of one redraw, to be drawn (`addresses`: the engine's, in the status line)."""
    return {"status": lambda: header.status_of(r, source, hosted, addresses), "banner": lambda: banner_html,
            "metrics": lambda: header.metrics(r, tally), "travel": lambda: travel.bar(r, connected, old),
            "card": lambda: header.reservation_card(r.view),
            "tables": lambda: tables_panel.data(r.view, r.colors, lit, *tables)}


def may_lane(r: Redraw | None, client: EngineClient, hosted: Hosted | None, page_mode: str, pending: dict) -> bool:
    """Redraw.lane_may_draw, the one rule, with the facts of this page and of its engine's process."""
    return r is not None and r.lane_may_draw(
        mode=page_mode, pending=bool(pending), died=hosted is not None and hosted.process.died,
        restarted=hosted is not None and hosted.client is not client)


def lane_composer(el: grid.Element, client: EngineClient, source: Source, hosted: Hosted | None, drawn_to: Drawn,
                  attached: tuple, tables: tuple[dict, str | None], page_mode: str,
                  pending: dict, addresses: bool) -> Callable[[dict], bytes | None]:
    """What composes the live views' next message off Streamlit's script thread, for their lane,
    with what this rerun read of the session; it gives None once the redraw needs the session
    again (by `may_lane`: the engine paused, stopped or restarted, a command's answer to show; or a
    panel that failed: a rerun says why in its place)."""
    def next_message(sync: dict) -> bytes | None:
        prof = grid.Profile()
        r = prof.timed("view", lambda: client.redraw())
        if not may_lane(r, client, hosted, page_mode, pending):
            return None
        tally = tally_since(attached, client, r)
        if tally is None:
            return None
        try:
            panels = prof.timed("panels", lambda: {name: draw() for name, draw in panels_of(
                r, source, hosted, tally, True, False, "", set(), tables, addresses).items()})
        except Exception:
            return None
        drawn_to.client, drawn_to.redraw = client, r
        return el.message(r.view, r.colors, sync, panels, {"connected": True, "highlight": []}, prof)
    return next_message


GRID = "pool_grid"  # the live views' element
ATTACHED = "attached"  # session state: (the client, its epoch, the event, the counters) at its first live draw


def own_tally(client: EngineClient, r: Redraw) -> Tally:
    """The counters since this session attached. Every session shares the client, whose own
    counters start where the first session attached it: a later one counts from its own first
    live redraw (earlier events and a reset or clean slate since keep the client's); one opened
    before the client's first snapshot counts all of it."""
    held = st.session_state.get(ATTACHED)
    if held is None or held[0] is not client or held[1] != r.view.epoch:
        if not r.view.live:
            return r.view.mirror.tally
        held = st.session_state[ATTACHED] = (client, r.view.epoch, r.event, r.view.mirror.tally.clone())
    return tally_since(held, client, r)


def tally_since(held: tuple, client: EngineClient, r: Redraw) -> Tally | None:
    """`own_tally` once the session has attached (`held`); None: it attached to another client or
    epoch (a rerun attaches it afresh)."""
    held_client, epoch, at, base = held
    if held_client is not client or epoch != r.view.epoch:
        return None
    tl = r.view.mirror.tally
    if r.event < at or base.since != tl.since or base.counted_nothing():
        return tl
    return tl.after(base, f"you attached (event {at:,})")


def drawn(panels: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Each panel's data; a panel that fails says so in its place ({"error": ...}, and its
    traceback above the views), and the others are drawn."""
    out = {}
    for name, draw in panels.items():
        try:
            out[name] = draw()
        except Exception as e:  # st.rerun and st.stop are BaseExceptions: they pass
            st.error(f"This panel ({name}) failed to draw: {type(e).__name__}: {e}")
            st.exception(e)
            out[name] = {"error": f"This panel failed to draw: {type(e).__name__}: {e}"}
    return out


def banner(r: Redraw, key, ringed: tuple[list[int], str] | None) -> str:
    """Where a run to the next key event stopped, explained, or the eviction the miss panel
    travelled to (HTML; empty when neither)."""
    if ringed:
        return f"{icon('troubleshoot')}<b>Event {r.event:,}</b> · {escape(ringed[1])}"
    if not key:
        return ""
    at = r.loop.stopped_at
    where = f"<b>Paused at event {r.event:,}</b>" + (
        f", the end of the step of the key event ({at:,})" if r.event != at else ", the key event")
    return f"{icon('fast_forward')}{where} · {escape(key.text)}"


def stopped_at(client: EngineClient, r: Redraw):
    """The key event a run-to-next-key-event stopped at, explained, while the engine waits there."""
    at, view = r.loop.stopped_at, r.view
    if not r.stopped_step:
        return None
    lesson = st.session_state.get(IN_LESSON)
    if lesson and lesson[0] is client and at <= lesson[1]:  # a lesson's stop, left behind in Explore
        return None
    if "key" not in view.memo:
        view.memo["key"] = explain(list(r.stopped_step), at, view.mirror.state)
    return view.memo["key"]


def died(source: Source, hosted: Hosted) -> None:
    proc = hosted.process
    if not roles.may_drive():
        st.error(f"The {source.label} died; the presenter can restart it.", icon=":material/heart_broken:")
        return
    with st.container(border=True):
        st.error(f"**The {source.label} died** ({proc.exit_reason()}). Its history up to then stays browsable "
                 "below, and after a restart too (*Browse the history before the restart*); Restart starts it "
                 "again with the pool config and pace it last had.",
                 icon=":material/heart_broken:")
        st.button("Restart engine", type="primary", key="restart_dead", on_click=restart, args=(source, proc))
        with st.expander("Its last lines"):
            st.code("\n".join(proc.tail(30)) or "(no output)")


def timeline_or_log(client: EngineClient, source: Source, hosted: Hosted | None) -> None:
    view = current_view(client)
    if view is not None:
        history_panels.panel(client, view, lessons_view.highlight() if mode() == "Lessons" else [])


# ------------------------------------------------------------------------------ the page
def loading(source: Source, hosted: Hosted) -> None:
    proc = hosted.process
    st.title("KVScope")
    if not roles.may_drive():  # its command line and log name paths: the presenter's only
        st.info(f"The presenter's {source.label} is starting.")
        st.fragment(lambda: proc.state == "starting" or st.rerun(), run_every=1.0)()
        return
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
    held = st.session_state.get(ATTACHED)
    if held is None or held[0] is not client:  # here before the client's first snapshot: its counts are ours
        st.session_state[ATTACHED] = (client, client.epoch + 1, 0, Tally())

    @st.fragment(run_every=0.5)
    def wait() -> None:
        if client.bounds() is not None or (hosted is not None and hosted.process.died):
            st.rerun()
        st.html(icons.CSS + header.status(client.status, client.hello, client.loop, client.url, source,
                                          hosted is not None and hosted.process.died, roles.may_drive()))
        st.info("Waiting for the engine's first snapshot. The client reconnects on its own; "
                "check the URL and token in the sidebar if this lasts.")

    wait()


def page(source: Source) -> None:
    """The live views (the pool grid beside the block tables), the history panel below; a trace
    being played has its capacity curve above them."""
    if source.kind == "trace":
        st.fragment(fragment_of(lambda c, s, h: trace_play_view.curve(c, s)), run_every=1.0, key="trace_curve")(source)
    # run by the grid: the browser asks for the next frame when it holds the last
    st.fragment(fragment_of(live_views), run_every=HEARTBEAT_S, key="live")(source)
    st.fragment(fragment_of(timeline_or_log), run_every=2.0, key="panel")(source)
