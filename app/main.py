"""KVScope dashboard: a paged KV cache, live. `streamlit run app/main.py` (options: app/link/source.py).

Routing only: the source picks the page (the fleet, a KV-event stream, the engine loading or
connecting), the sidebar's mode picks among Explore and Lessons (the live pool page,
app/modes/live.py) and the Lab. The sidebar drives the engine.
"""
from __future__ import annotations

import streamlit as st
from streamlit import config as st_config

from app.ui import controls, quiet_log, roles, stale, travel
from app.modes import fleet_view, kv_events_view, lab_view, lessons_view, live
from app.link.source import ASSETS, Source, from_command_line

# Streamlit runs a full gc.collect(2) after every script run; with ~100k events in the history
# that costs ~60 ms, ten times a second. Python's own generational GC still runs.
st_config.set_option("runner.postScriptGC", False)
quiet_log.install()
MODES = {"Explore": ":material/explore: Explore", "Lessons": ":material/school: Lessons",
         "Lab": ":material/science: Lab"}


MODE_BEFORE = "mode_before"  # session state: the mode selected last (a second click on it deselects it)


def _mode_changed() -> None:
    if st.session_state.get("mode") is None:  # the selected mode clicked again: it stays selected
        st.session_state["mode"] = st.session_state.get(MODE_BEFORE, "Explore")
        return
    st.session_state[MODE_BEFORE] = st.session_state["mode"]
    if st.session_state["mode"] == "Lessons":  # a lesson resets the pool: the scenario's requests go
        st.session_state.pop(controls.LAST_SCENARIO, None)
    travel.go_live()
    stale.mark()


def main() -> None:
    # the tab icon is a file of ours (a data URL): a Material icon's is fetched from fonts.gstatic.com
    st.set_page_config(page_title="KVScope", page_icon=ASSETS / "favicon.svg", layout="wide",
                       initial_sidebar_state="expanded")
    stale.full_run()
    roles.claim()
    drives = roles.may_drive()  # shared: only the presenter's session; its viewers get the views
    source: Source = st.session_state.setdefault("source", from_command_line())
    client, hosted = (None, None) if source.kind in ("kv_events", "fleet") else live.pick(source)
    with st.sidebar:
        st.markdown("## :material/grid_view: KVScope\nA paged KV cache, live: every block the allocator hands out.")
        if drives:
            fleet_view.back_button()
            controls.connection(source, client, hosted)
        else:
            roles.viewer_note()
    if source.kind == "fleet":  # many engines: a page of its own
        return fleet_view.page(source)
    if source.kind == "kv_events":  # no pool, no engine: a page of its own
        return kv_events_view.page(source)
    if client is None:
        return live.loading(source, hosted)
    if client.bounds() is None:
        return live.connecting(client, source, hosted)
    with st.sidebar:
        controls.unsupported_note(client)
        modes = list(MODES) if drives else ["Explore", "Lessons"]  # a viewer reads the presenter's lesson along
        st.segmented_control("Mode", modes, format_func=MODES.get, key="mode",
                             default="Lessons" if lessons_view.autostarting() else "Explore",
                             label_visibility="collapsed", on_change=_mode_changed)
        if live.mode() == "Lessons":
            st.subheader("Lessons")
            st.fragment(live.fragment_of(lambda c, s, h: lessons_view.sidebar(c)), run_every=0.5, key="lessons")(source)
            lessons_view.back_from_own_engine()
        elif live.mode() == "Explore" and drives:
            lessons_view.left_behind(client)
            st.subheader("Prompt")
            controls.prompt_form(client)
            st.fragment(live.fragment_of(lambda c, s, h: controls.engine_panel(c, live.current_view(c))), run_every=1.0,
                        key="engine")(source)
        with st.expander("Display"):
            st.selectbox("Grid redraws", list(live.REFRESH), key="refresh", on_change=stale.mark)
    if live.mode() == "Lab":
        return lab_view.page(client)
    live.page(source)


main()
