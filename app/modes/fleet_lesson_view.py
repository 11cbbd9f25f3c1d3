"""The routing lesson on the fleet page: a card above the engines' cards with the lesson's
controls (Start, Next, Back, Restart) and the viewed stop's caption, filled with the fleet's
numbers when the stop was reached (app/lessons/fleet_lesson.py runs it)."""
from __future__ import annotations

import streamlit as st

from app.fleet.engines import Fleet
from app.link.source import Source
from app.lessons.fleet_lesson import FleetLessonRun, all_fleet_lessons, caption, can_drive

KEY = "fleet_lesson"  # session state: the FleetLessonRun in progress
REDRAW_S = 0.5
OPEN = "fleet_lesson_open"  # session state: show the lesson's card open (arriving from the Lessons mode)


def lessons():
    return {lesson.key: lesson for lesson in all_fleet_lessons()}


def current() -> FleetLessonRun | None:
    return st.session_state.get(KEY)


def _start(fleet: Fleet, key: str, model: str) -> None:
    run = st.session_state[KEY] = FleetLessonRun(lessons()[key], fleet, model)
    run.next()


def panel(fleet: Fleet, source: Source) -> None:
    """The lesson's card (a fragment: it redraws while a stop runs)."""
    run = current()
    all_ = lessons()
    lesson = run.lesson if run is not None else next(iter(all_.values()))
    with st.expander(f":material/school: Lesson: {lesson.title}",
                     expanded=run is not None or bool(st.session_state.get(OPEN))):
        with st.container(key="fleet_lesson_card"):
            _card(fleet, source, run, lesson)


def _card(fleet: Fleet, source: Source, run: FleetLessonRun | None, lesson) -> None:
    drivable = sum(can_drive(e) for e in fleet.members())
    if run is None or run.fleet is not fleet:
        st.markdown(lesson.goal)
        st.caption(f"It runs on the first two live engines here that take prompts and can be cleared; with fewer "
                   f"({drivable} now) it starts two KVScope engines of its own ({source.model}, 128 blocks of 16).")
        st.button("Start the lesson", type="primary", icon=":material/school:", key="fleet_lesson_start",
                  on_click=_start, args=(fleet, lesson.key, source.model))
        return
    total = len(run.lesson.stops)
    c = st.columns([1, 1, 1, 4])
    # keyed by the stop shown, as the engine lesson's (app/modes/lessons_view.py says why)
    c[0].button("Next", icon=":material/arrow_forward:", key=f"fleet_lesson_next@{run.viewing}", type="primary",
                width="stretch",
                disabled=run.pending is not None or bool(run.errors) or run.at_end,
                on_click=run.next, args=(run.viewing,),
                help="Run to the next stop (or show the next one reached before)")
    c[1].button("Back", icon=":material/arrow_back:", key=f"fleet_lesson_back@{run.viewing}", width="stretch",
                disabled=run.pending is not None or run.viewing <= 0, on_click=run.back,
                args=(run.viewing,))
    c[2].button("Restart", icon=":material/replay:", key="fleet_lesson_restart", width="stretch",
                disabled=run.pending is not None, on_click=_start, args=(fleet, run.lesson.key, source.model))
    c[3].caption(run.outline())
    for msg in run.errors[-3:]:
        st.error(msg)
    if run.pending is not None:
        st.markdown(f"**{run.lesson.title}** · stop {run.pending + 1} of {total} · *{run.progress}* …")
        return
    if run.viewing < 0:
        return
    stop = run.stop
    st.markdown(f"**{run.lesson.title}** · stop {run.viewing + 1} of {total} · *{stop.title}*"
                + ("" if run.at_latest else " · :orange[a stop reached earlier: the "
                   "engines below show the fleet now]"))
    st.markdown(caption(stop, run.words()))
    if run.at_end:
        st.caption("End of the lesson: **Restart** runs it again. The load generator in the sidebar sends the "
                   "same workload with the policy and size you choose.")
