"""KVScope dashboard: a paged KV cache, live. `streamlit run app/main.py` (options: app/source.py).

The page is a few fragments that redraw on their own timers from the shared client's state
at the session's chosen event (live, or travelled back to): the header, the pool grid, the
block tables, and the timeline with the event log. The sidebar drives the engine.
"""
from __future__ import annotations

import time

import streamlit as st
from streamlit import config as st_config

from engine.contract import protocol as p
from engine.contract.kinds import DEFAULT_LOG_KINDS
from app import controls, eventlog, grid, header, tables, timeline, travel
from app.client import EngineClient, View
from app.commands import show_replies
from app.connection import Hosted, resolve, restart
from app.source import Source, from_command_line

# Streamlit runs a full gc.collect(2) after every script run; with ~100k events in the history
# that costs ~60 ms, ten times a second. Python's own generational GC still runs.
st_config.set_option("runner.postScriptGC", False)
# Intervals between grid reruns: the browser starts the next one only after the last one's round
# trip (30-40 ms on a busy 2-core machine), so "10 per second" asks for a rerun every 60 ms.
REFRESH = {"10 per second": 0.06, "5 per second": 0.15, "2 per second": 0.45}


def current_view(client: EngineClient) -> View | None:
    return client.view(travel.target())


# ---------------------------------------------------------------------------------- fragments
def top(client: EngineClient, source: Source) -> None:
    show_replies(client)
    header.status_line(client, source)
    view = current_view(client)
    if view is None:
        return
    left, right = st.columns([3, 2], gap="medium")
    with left:
        header.metrics(view, client)
    with right:
        header.reservation_card(view)
    travel.bar(client, view)


def pool_grid(client: EngineClient) -> None:
    view = current_view(client)
    if view is None:
        return
    if "grid" not in view.memo:
        view.memo["grid"] = grid.payload(view, client.colors)
    grid.draw(view.memo["grid"], on_block=_filter_log_by_block)


def _filter_log_by_block() -> None:
    block = st.session_state["pool_grid"].get("block")
    if block is not None:
        st.session_state["log_filter"] = ("", int(block))
        st.session_state["panel_shown"] = "Event log"
        st.session_state["log_version"] = st.session_state.get("log_version", 0) + 1
        st.rerun(["panel"])


def block_tables(client: EngineClient) -> None:
    view = current_view(client)
    if view is None:
        return
    live_tab, done_tab = st.tabs(["Block tables", "Finished requests"])
    if "tables" not in view.memo:
        view.memo["tables"] = tables.render(view, client.colors)
    with live_tab, st.container(height=640, border=False):  # scrolls, so the history stays in reach
        st.html(view.memo["tables"])
    with done_tab, st.container(height=640, border=False):
        st.html(tables.render_finished(list(view.mirror.finished), client.colors))


def timeline_or_log(client: EngineClient) -> None:
    view = current_view(client)
    if view is None:
        return
    at_step = None if view.live else (view.step_events[-1].step if view.step_events else None)
    # one panel at a time: only the chosen one is computed and sent (a grid click remounts it on the log)
    panel = st.segmented_control("History", ["Timeline", "Event log"], key=f"panel_{_log_version()}",
                                 default=st.session_state.get("panel_shown", "Timeline"),
                                 label_visibility="collapsed") or "Timeline"
    st.session_state["panel_shown"] = panel
    if panel == "Event log":
        return event_log(client, view)
    points, markers = client.timeline(view.event)
    if len(points) < 2:
        st.caption("The timeline fills in as the engine runs steps.")
        return
    c = st.columns(2)
    c[0].vega_lite_chart(timeline.blocks_chart(points, markers, at_step), width="stretch")
    c[1].vega_lite_chart(timeline.rates_chart(points, at_step), width="stretch")


def event_log(client: EngineClient, view: View) -> None:
    # A click on the grid sets the filters by remounting their widgets (a new key) with new
    # values: writing a live widget's value from Python races the other fragments' reruns.
    seq0, block0 = st.session_state.get("log_filter", ("", -1))
    v = _log_version()
    c = st.columns([4, 2, 1])
    kinds = c[0].multiselect("Kinds", p.EVENT_KINDS, default=list(DEFAULT_LOG_KINDS), key="log_kinds")
    seq = c[1].text_input("Sequence or request", seq0, key=f"log_seq_{v}", placeholder="all, e.g. r1 or sys1-2")
    block = c[2].number_input("Block", -1, 65535, block0, key=f"log_block_{v}", help="-1: every block. "
                              "Clicking a block in the grid picks it.")
    st.session_state["log_filter"] = (seq, block)
    events = client.events_before(None if view.live else view.event, 50_000)
    df = eventlog.frame(events, set(kinds), seq.strip(), None if block < 0 else int(block))
    st.session_state["log_rows"] = df["event"].tolist()
    st.dataframe(eventlog.styled(df), key="event_log", on_select=_travel_to_selected, selection_mode="single-row",
                 hide_index=True, height=340, width="stretch",
                 column_config={"t (s)": st.column_config.NumberColumn(format="%.3f"),
                                "what happened": st.column_config.TextColumn(width="large")})
    st.caption("Newest first. Select a row to travel to that event; **Live** returns.")


def _log_version() -> int:
    return st.session_state.get("log_version", 0)


def _travel_to_selected() -> None:
    rows = st.session_state["event_log"].selection.rows
    if rows:
        travel.go(st.session_state["log_rows"][rows[0]])


# ------------------------------------------------------------------------------ the page
def loading(source: Source, hosted: Hosted) -> None:
    proc = hosted.process
    st.title("KVScope")
    if proc.state == "exited":
        st.error(f"{source.label} stopped before it was ready (exit code {proc.returncode}). Its last lines:")
        st.code("\n".join(proc.tail(30)) or "(no output)")
        st.button("Retry", type="primary", on_click=restart, args=(source,))
        return

    @st.fragment(run_every=0.5)
    def progress() -> None:
        if proc.state != "starting":
            st.rerun()
        with st.status(f"Starting the {source.label}: {time.time() - proc.started:.0f} s", expanded=True,
                       state="running"):
            st.caption(f"`{proc.command}` · loading the model takes a few seconds; the very first run "
                       "converts the bundled GGUF once (about 20 s more)")
            st.code("\n".join(proc.tail(12)) or "starting Python…")

    progress()


def connecting(client: EngineClient, source: Source) -> None:
    st.title("KVScope")

    @st.fragment(run_every=0.5)
    def wait() -> None:
        if client.view() is not None:
            st.rerun()
        header.status_line(client, source)
        st.info("Waiting for the engine's first snapshot. The client reconnects on its own; "
                "check the URL and token in the sidebar if this lasts.")

    wait()


def sidebar(client: EngineClient, view: View) -> None:
    replay = client.is_replay
    cfg = view.mirror.config
    if replay:
        st.info("Replaying a recording: prompts, scenarios and resets need a live engine.")
    st.subheader("Prompt")
    controls.prompt_form(client, disabled=replay)
    st.subheader("Scenarios")
    controls.scenarios(client, view, disabled=replay)
    st.subheader("Engine")
    controls.engine(client, view, replay)
    if not replay:
        with st.expander(f"Reset pool · {cfg.num_device_blocks} × {cfg.block_size} tokens"):
            controls.reset_form(client, view)
    with st.expander("Display"):
        st.selectbox("Grid redraws", list(REFRESH), key="refresh")
    if err := st.session_state.get("last_error"):
        st.caption(f"Last error: {err}")


def main() -> None:
    st.set_page_config(page_title="KVScope", page_icon=":material/grid_view:", layout="wide", initial_sidebar_state="expanded")
    source: Source = st.session_state.setdefault("source", from_command_line())
    client, hosted = resolve(source)
    with st.sidebar:
        st.markdown("## :material/grid_view: KVScope\nA paged KV cache, live: every block the allocator hands out.")
        controls.connection(source, client, hosted)
    if client is None:
        return loading(source, hosted)
    view = current_view(client)
    if view is None:
        return connecting(client, source)
    with st.sidebar:
        sidebar(client, view)
    st.fragment(top, run_every=1.0, key="top")(client, source)
    left, right = st.columns([3, 2], gap="medium")
    with left:
        st.fragment(pool_grid, run_every=REFRESH[st.session_state.get("refresh", "10 per second")],
                    key="grid")(client)
    with right:
        st.fragment(block_tables, run_every=0.5, key="tables")(client)
    st.fragment(timeline_or_log, run_every=2.0, key="panel")(client)


main()
