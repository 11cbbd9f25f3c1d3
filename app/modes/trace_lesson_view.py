"""The lesson on real traffic on the Lab's Trace page: a card above the sweep's inputs with the
lesson's controls (Start, Next, Back, Restart), the viewed stop's caption filled with its sweep's
numbers, its curve with the point it is about marked, and the command that gives the same sweep
(app/lessons/trace_lesson.py runs it)."""
from __future__ import annotations

import os
import shlex

import streamlit as st

from app.lessons.trace_lesson import TraceLessonRun, all_trace_lessons, caption, marked
from app.link.lab_run import sweep_args
from app.modes.lab_trace_view import chart

KEY = "trace_lesson"  # session state: the TraceLessonRun in progress
OPEN = "trace_lesson_open"  # session state: the key of the lesson to show open (arriving from the Lessons mode)
REDRAW_S = 0.5


def lessons():
    return {lesson.key: lesson for lesson in all_trace_lessons()}


def current() -> TraceLessonRun | None:
    return st.session_state.get(KEY)


def _start(key: str) -> None:
    run = st.session_state[KEY] = TraceLessonRun(lessons()[key])
    run.next()


def panel() -> None:
    """The lesson's card (a fragment: it redraws while a stop runs)."""
    run = current()
    all_ = lessons()
    lesson = run.lesson if run is not None else all_.get(st.session_state.get(OPEN), next(iter(all_.values())))
    with st.expander(f":material/school: Lesson: {lesson.title}",
                     expanded=run is not None or bool(st.session_state.get(OPEN))):
        with st.container(key="trace_lesson_card"):
            _card(run, lesson)


def _card(run: TraceLessonRun | None, lesson) -> None:
    if run is None or run.lesson.key != lesson.key:
        st.markdown(lesson.goal)
        st.button("Start the lesson", type="primary", icon=":material/school:", key="trace_lesson_start",
                  on_click=_start, args=(lesson.key,))
        return
    total = len(lesson.stops)
    c = st.columns([1, 1, 1, 4])
    # keyed by the stop shown, as the engine lesson's (app/modes/lessons_view.py says why)
    c[0].button("Next", icon=":material/arrow_forward:", key=f"trace_lesson_next@{run.viewing}", type="primary",
                width="stretch", disabled=run.pending is not None or bool(run.errors) or run.at_end,
                on_click=run.next, args=(run.viewing,), help="Run the next stop's sweep (or show it, if run before)")
    c[1].button("Back", icon=":material/arrow_back:", key=f"trace_lesson_back@{run.viewing}", width="stretch",
                disabled=run.pending is not None or run.viewing <= 0, on_click=run.back, args=(run.viewing,))
    c[2].button("Restart", icon=":material/replay:", key="trace_lesson_restart", width="stretch",
                disabled=run.pending is not None, on_click=_start, args=(lesson.key,))
    c[3].caption(run.outline())
    for msg in run.errors[-3:]:
        st.error(msg)
    if run.pending is not None:
        st.markdown(f"**{lesson.title}** · stop {run.pending + 1} of {total} · *{run.progress}* …")
        return
    if run.viewing < 0:
        return
    stop, sweep = run.stop, run.sweep()
    st.markdown(f"**{lesson.title}** · stop {run.viewing + 1} of {total} · *{stop.title}*")
    st.markdown(caption(stop, run.words()))
    st.vega_lite_chart(chart(sweep, marked(stop, sweep), height=300), width="stretch",
                       key=f"trace_lesson_chart@{run.viewing}")
    policies, capacities, host = run.command(run.viewing)
    argv = sweep_args(os.path.relpath(lesson.path), policies, capacities, one_at_a_time=lesson.one_at_a_time,
                      bytes_per_token=lesson.bytes_per_token, host_blocks=host)
    st.caption("The same sweep from a shell (the table, the misses by reason): run it from the checkout.")
    st.code("python -m engine.lab " + shlex.join(argv), language="bash", wrap_lines=True)
    if run.at_end:
        st.caption("End of the lesson: **Restart** runs it again. The sweep below takes your own trace, other "
                   "policies (your own too) and host tiers, and plays any point in the pool.")
