"""The Lessons mode: pick a lesson; Next runs the engine to the next stop (or shows one reached
before), Back shows the previous one as the history kept it, Restart starts over. Each stop's
caption is drawn above the grid, and its blocks are highlighted in the grid and the tables.

A shared dashboard's viewers read along (app/ui/roles.py): their Lessons mode shows the lesson the
presenter runs on the same source, the stop the presenter shows (their views travel to it each
time it changes, and are theirs in between), never a control of it."""
from __future__ import annotations

from functools import lru_cache

import streamlit as st

from kvscope_contract import protocol as p
from app.link.client import EngineClient
from app.ui.commands import send
from app.lessons.lesson import Lesson, all_lessons, caption
from app.lessons.runner import LessonRun
from app.modes import fleet_lesson_view, trace_lesson_view
from app.link.source import Source
from app.derived.words import plural
from app.ui import roles

KEY = "lesson"  # session state: the LessonRun in progress
BEFORE = "pool_before_lesson"  # session state: (ResetConfig, paused, pace) the engine had before a lesson
AUTOSTART = "lesson_autostart"  # session state: the lesson to start once the engine started for it is ready
SOURCE_BEFORE = "source_before_lesson"  # session state: the source before a lesson's own engine
FOLLOWED = "lesson_followed"  # session state, a viewer's: the presenter's stop its views last travelled to
PANEL_OPENED = "lesson_panel_opened"  # session state: the stop whose panel this session opened

# the lesson run last started on each source, which a shared dashboard's viewers read along: the
# presenter's session drives it (`drive` polls it), a viewer's only reads it
_presented: dict[Source, LessonRun] = {}


@lru_cache(maxsize=1)
def lessons() -> dict[str, Lesson]:
    return {lesson.key: lesson for lesson in all_lessons()}


def current() -> LessonRun | None:
    """This session's lesson run; a viewer's: the one the presenter runs on its source."""
    if roles.may_drive():
        return st.session_state.get(KEY)
    return _presented.get(st.session_state.get("source"))


def _travel(n: int | None) -> None:
    """Show event n (None: live). The views follow on their own timers; no `st.rerun` of other
    fragments from here: from a callback of a fragment's widget it can stop that fragment's timer."""
    st.session_state["travel"] = n


def _start(client: EngineClient, key: str) -> None:
    if BEFORE not in st.session_state and (view := client.view()) is not None:  # what Explore had
        cfg = view.mirror.config
        st.session_state[BEFORE] = (p.ResetConfig(
            block_size=cfg.block_size, num_device_blocks=cfg.num_device_blocks, num_host_blocks=cfg.num_host_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching, preemption_mode=cfg.preemption_mode,
            max_num_seqs=cfg.max_num_seqs, num_offload_blocks=cfg.num_offload_blocks), client.loop.paused,
            client.loop.step_delay_ms)
    run = st.session_state[KEY] = LessonRun(lessons()[key])
    _presented[st.session_state.get("source")] = run
    run.next(client)
    _travel(None)


def _next(client: EngineClient, seen: int) -> None:
    _travel(current().next(client, seen))


def _back(seen: int) -> None:
    _travel(current().back(seen))


def autostarting() -> bool:
    """Whether a lesson waits for the engine started for it (the page comes back in Lessons mode)."""
    return st.session_state.get(AUTOSTART) is not None


def hybrid(client: EngineClient) -> bool:
    """Whether the engine's pool has sliding-window KV-cache groups beside full attention."""
    view = client.view()
    return view is not None and len(view.mirror.config.groups) > 1


def sidebar(client: EngineClient) -> None:
    """The lesson picker and its controls (a fragment body: it also notices a stop reached); a
    viewer's: the presenter's lesson, read only."""
    if not roles.may_drive():
        return _read_along()
    if st.session_state.get("mode") != "Lessons":  # a click here opened a lesson elsewhere (the Lab)
        st.rerun(scope="app")
    run = current()
    if run is not None:
        run.poll(client)  # the other views follow on their own timers
    all_ = lessons()
    traces = {TRACE + k: v for k, v in trace_lesson_view.lessons().items()}  # lessons on a trace, in the Lab
    fleet = {FLEET + k: v for k, v in fleet_lesson_view.lessons().items()}  # lessons over two engines
    keys = list(all_) + list(traces) + list(fleet)
    auto = st.session_state.get(AUTOSTART)
    pick = st.selectbox("Lesson", keys, key="lesson_pick",
                        index=keys.index(run.lesson.key) if run else keys.index(auto) if auto in keys else 0,
                        format_func=lambda k: f"{keys.index(k) + 1}. {(all_ | traces | fleet)[k].title}")
    if pick in traces:
        return _trace_lesson(pick)
    if pick in fleet:
        return _fleet_lesson(fleet[pick])
    lesson = all_[pick]
    can_drive = client.supports("run_until") and client.supports("reset") and client.supports("submit")
    if not can_drive:
        st.warning("Lessons drive a live KVScope engine (reset, submit, run until): this source cannot.")
    if lesson.model and not hybrid(client):
        return _own_engine(lesson)
    if auto == pick and can_drive and (run is None or run.lesson.key != pick):  # its engine is ready: go
        st.session_state.pop(AUTOSTART, None)
        _start(client, pick)
        run = current()
    if run is None or run.lesson.key != pick:
        st.caption(lesson.goal)
        st.button("Start the lesson", type="primary", icon=":material/school:", key="lesson_start", width="stretch",
                  disabled=not can_drive, on_click=_start, args=(client, pick),
                  help="Resets the engine to the lesson's pool and submits its requests")
        return
    # keyed by the stop shown: Streamlit delivers a click again in the run after one a newer rerun cut
    # off, with the arguments that cut-off run drew; the stop's key keeps the click on the stop it was for
    st.button("Next", icon=":material/arrow_forward:", key=f"lesson_next@{run.viewing}", type="primary",
              width="stretch",
              disabled=run.pending is not None or run.at_end,
              on_click=_next, args=(client, run.viewing),
              help="Run to the next stop (or show the next one reached before)")
    c = st.columns(2)
    c[0].button("Back", icon=":material/arrow_back:", key=f"lesson_back@{run.viewing}", width="stretch",
                disabled=run.pending is not None or run.viewing <= 0, on_click=_back, args=(run.viewing,),
                help="Show the previous stop as it was (time travel)")
    c[1].button("Restart", icon=":material/replay:", key="lesson_restart", width="stretch",
                disabled=not can_drive, on_click=_start, args=(client, pick))
    _outline(run)
    for msg in run.errors[-3:]:
        st.caption(f":red[{msg}]")
    for note in run.notes[-3:]:
        st.caption(f":orange[{note}]")


def _outline(run: LessonRun) -> None:
    outline = []
    for i, stop in enumerate(run.lesson.stops):
        mark = ("▶" if i == run.viewing else "✓") if i < len(run.reached) else (
            "…" if run.pending and run.pending.index == i else "○")
        outline.append(f"{mark} {i + 1}. {stop.title or stop.caption.split('.')[0][:40]}")
    st.caption("  \n".join(outline))


def _read_along() -> None:
    run = current()
    if run is None:
        st.caption("When the presenter starts a lesson, you read along here: its stops, and each stop's "
                   "explanation above the pool.")
        return
    st.markdown(f"**{run.lesson.title}**")
    st.caption("The presenter's lesson: your views go to each stop the presenter shows, and are yours in between.")
    _outline(run)


def _own_engine(lesson: Lesson) -> None:
    """A lesson that needs a hybrid model (sliding windows) on an engine that has none: one click
    starts an engine of the lesson's model (the dashboard's own, as the embedded engine starts) and
    the lesson on it once it is ready."""
    st.caption(lesson.goal)
    source = st.session_state.get("source")
    if source is not None and source.kind == "embedded" and source.model == lesson.model:
        st.error(f"This engine runs `{lesson.model}` but its pool has a single KV-cache group: it gives the "
                 "model's sliding-window layers no groups of their own, so the lesson cannot show them.")
        return
    st.caption(f"It needs a model with sliding-window layers, which this engine's pool has not: the dashboard "
               f"starts an engine of its own on `{lesson.model}` (under a minute; the first time it converts the "
               "bundled model once, a minute more) and the lesson on it. *Back* returns to this engine.")
    st.button(f"Start {lesson.model} and the lesson", type="primary", icon=":material/school:", key="lesson_own_engine",
              width="stretch", on_click=_open_own_engine, args=(lesson,))


def _open_own_engine(lesson: Lesson) -> None:
    source = st.session_state.get("source")
    if SOURCE_BEFORE not in st.session_state:
        st.session_state[SOURCE_BEFORE] = source
    st.session_state.update({"source": Source("embedded", model=lesson.model), AUTOSTART: lesson.key,
                             "travel": None, "frame": None})
    st.session_state.pop(KEY, None)


def back_from_own_engine() -> None:
    """On the engine a lesson started for itself: the way back to the one before. Drawn outside
    the sidebar's fragment: a click on a fragment redrawn twice a second could be lost while a
    slow machine redraws it (CI lost this one once), and this one needs a whole page anyway."""
    before = st.session_state.get(SOURCE_BEFORE)
    if before is None or st.session_state.get("source") == before:
        return
    st.button(f"Back to the {before.label}", icon=":material/undo:", key="lesson_back_engine", width="stretch",
              on_click=_back_to, args=(before,), help="The lesson's engine keeps running for a return")


def _back_to(before: Source) -> None:
    for key in (SOURCE_BEFORE, AUTOSTART, KEY, BEFORE):
        st.session_state.pop(key, None)
    st.session_state.update({"source": before, "travel": None, "frame": None})


FLEET = "fleet:"  # the picker's key of a lesson that runs on the fleet page
TRACE = "trace:"  # the picker's key of a lesson that runs on the Lab's Trace page


def _trace_lesson(pick: str) -> None:
    """A lesson on a request trace runs in the Lab, with no engine: say so and go there."""
    lesson = trace_lesson_view.lessons()[pick.removeprefix(TRACE)]
    st.caption(lesson.goal)
    st.caption("It runs in the Lab (workload Trace), on a trace bundled with KVScope: the engine here is left as "
               "it is.")
    st.button("Open it in the Lab", type="primary", icon=":material/science:", key="lesson_trace_open",
              width="stretch", on_click=_open_trace, args=(pick.removeprefix(TRACE),))


def _open_trace(key: str) -> None:
    st.session_state.update({"mode": "Lab", "lab_source": "Trace", trace_lesson_view.OPEN: key})


def _fleet_lesson(lesson) -> None:
    """A lesson over two engines runs on the fleet page: say so and go there (back to the fleet this
    engine was opened from, if it was)."""
    st.caption(lesson.goal)
    if st.session_state.get("fleet_back") is not None:
        st.caption("It runs over two engines, on the fleet page: the fleet you came from (its first two live "
                   "engines that take prompts, or two KVScope engines of its own).")
    else:
        st.caption("It runs over two engines, on the fleet page: it starts two KVScope engines of its own.")
    st.button("Open it on the fleet page", type="primary", icon=":material/hub:", key="lesson_fleet_open",
              width="stretch", on_click=_open_fleet)


def _open_fleet() -> None:
    source = st.session_state.get("source")
    back = st.session_state.get("fleet_back")  # the fleet page this engine was opened from
    model = source.model if source is not None and source.kind == "embedded" else "smollm2"
    fleet = back if back is not None else Source("fleet", model=model)
    st.session_state.update({"source": fleet, fleet_lesson_view.OPEN: True, "travel": None})


def drive(client: EngineClient) -> None:
    """Before a redraw of the live views (which redraw many times a second; the sidebar's fragment
    polls too): the lesson's run goes on (its `RunUntil` answered, a stop reached, the next run
    sent) and the viewed stop's words are worked out, so that `stage` reads no client: every
    panel of a redraw describes the Redraw it is given (app/link/client.py, Redraw)."""
    run = current()
    if run is None:
        return
    if roles.may_drive():
        run.poll(client)
    elif st.session_state.get(FOLLOWED) != (shown := (id(run), run.viewing, len(run.reached), run.pending is None)):
        st.session_state[FOLLOWED] = shown  # the presenter moved: the viewer's views go where the presenter's are
        _travel(None if run.pending is not None or run.at_latest else run.travel_target())
    if run.pending is None and run.viewing >= 0:
        memo_key = (client.epoch, run.viewing, len(run.reached))
        if run.memo.get("key") != memo_key:  # the stop's words change only when it does
            run.memo.update(key=memo_key, words=run.words(client))


def stage() -> list[int]:
    """Above the grid: the viewed stop's caption (or the lesson's goal, or what it waits for), as
    `drive` left them. Returns the blocks to highlight."""
    run = current()
    if run is None:
        st.session_state["lesson_blocks"] = []
        if not roles.may_drive():
            st.info("The presenter has no lesson running: when one starts, its explanations show here, stop by "
                    "stop.", icon=":material/school:")
            return []
        st.info("Pick a lesson in the sidebar and press **Start**: it resets the engine to its own pool, "
                "submits its requests and stops at each key moment with an explanation.", icon=":material/school:")
        return []
    total = len(run.lesson.stops)
    with st.container(border=True, key="lesson_card"):
        if run.pending is not None:
            stop = run.lesson.stops[run.pending.index]
            what = ", ".join(stop.until) if stop.until else f"{stop.steps} steps"
            st.markdown(f"**{run.lesson.title}** · stop {run.pending.index + 1} of {total} · running until "
                        f"*{what}* …")
            return []
        if run.viewing < 0:
            st.markdown(f"**{run.lesson.title}**\n\n{run.lesson.goal}")
            return []
        memo_key = run.memo["key"]
        values, fx = run.memo["words"]
        stop = run.stop
        st.markdown(f"**{run.lesson.title}** · stop {run.viewing + 1} of {total}"
                    + (f" · *{stop.title}*" if stop.title else "")
                    + ("" if run.at_latest else " · :orange[a stop reached earlier]"))
        st.markdown(caption(stop, values))
        opened = (id(run), memo_key)
        if stop.panel and st.session_state.get(PANEL_OPENED) != opened:  # once per stop: the reader may pick another
            st.session_state[PANEL_OPENED] = opened
            st.session_state["panel_shown"] = stop.panel
            st.session_state["log_version"] = st.session_state.get("log_version", 0) + 1  # remounts the picker
        if run.at_end and roles.may_drive():
            st.caption("End of the lesson: **Restart** runs it again; pick another lesson in the sidebar.")
        st.session_state["lesson_blocks"] = fx.blocks
        return fx.blocks


def highlight() -> list[int]:
    """The blocks the viewed stop points at (for the block tables)."""
    run = current()
    return st.session_state.get("lesson_blocks", []) if run is not None and run.viewing >= 0 else []


def _describe(cfg) -> str:
    tier = f"a host tier of {plural(cfg.num_offload_blocks, 'block')}, " if cfg.num_offload_blocks else ""
    return (f"{plural(cfg.num_device_blocks, 'block')} of {cfg.block_size}, "
            f"{plural(cfg.num_host_blocks, 'host block')}, {tier}"
            f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}, {cfg.preemption_mode}")


def left_behind(client: EngineClient) -> None:
    """In Explore after a lesson: the engine is still on the lesson's pool (and paused, as the
    lesson left it). Say so, and offer the pool (and pause and pace) Explore had before."""
    before = st.session_state.get(BEFORE)
    view = client.view()
    if before is None or view is None:
        return
    pool, paused, pace = before
    cfg = view.mirror.config
    same = pool.apply_to(cfg) == cfg and client.loop.paused == paused
    if same:
        st.session_state.pop(BEFORE, None)
        return
    with st.container(border=True, key="left_behind"):
        st.markdown(f":orange[:material/school: **The engine is still on the lesson's pool**]: {_describe(cfg)}"
                    + (", **paused**" if client.loop.paused else "") + f". Before the lesson it had "
                                                                       f"{_describe(pool.apply_to(cfg))}"
                    + (", paused" if paused else ", running") + ".")
        c = st.columns(2)
        c[0].button("Restore it", key="restore_pool", type="primary", width="stretch", on_click=_restore,
                    args=(client, before), help="Reset the engine to the pool it had before the lesson, and its pace")
        c[1].button("Keep it", key="keep_lesson_pool", width="stretch",
                    on_click=lambda: st.session_state.pop(BEFORE, None))


def _restore(client: EngineClient, before) -> None:
    pool, paused, pace = before
    cmds = [p.ResetCmd(config=pool), p.Pace(step_delay_ms=pace)] + ([] if paused else [p.Resume()])
    for cmd in cmds:
        send(client, cmd, "Restore the pool from before the lesson", quiet=not isinstance(cmd, p.ResetCmd))
    st.session_state.pop(BEFORE, None)
