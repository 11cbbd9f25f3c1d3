"""Driving and reading the dashboard under AppTest, for the tests of tests/integration/ (their
fixtures, an engine server and the app on it, are in tests/integration/conftest.py)."""
from __future__ import annotations

import re

import streamlit as st
from streamlit.testing.v1 import AppTest

from kvscope_contract import protocol as p
from kvscope_contract.kinds import kind_of
from app import streamlit_argv
from app.panels import grid
from app.link.client import EngineClient
from app.lessons.lesson import all_lessons
from tests.lesson_claims import CLAIMS, GOALS, AtStop
from tests.waiting import wait

MAIN = str(streamlit_argv.MAIN)  # app/main.py
DEFAULT_POOL = p.ResetConfig(block_size=16, num_device_blocks=256, num_host_blocks=128, max_num_seqs=16,
                             enable_prefix_caching=True, preemption_mode="swap", num_offload_blocks=0)
LESSONS = {lesson.key: lesson for lesson in all_lessons()}


def events(c: EngineClient, kind: str, since: int = 0) -> list:
    with c.lock:
        return [e for e in c.history.events if e.seq > since and e.__struct_config__.tag == kind]


def grid_data(at: AppTest, name: str = "kvscope_grid") -> dict | None:
    """The header of the grid's last frame (app/panels/grid.py), as the canvas reads it."""
    for el in at.get("bidi_component"):
        if el.proto.component_name == name:
            return grid.read(el.proto.bytes)[0]
    return None


def panels(at: AppTest) -> dict:
    """The live views' data sent with the grid's last frame (app/modes/live.py: each panel of
    the redraw; AppTest's browser holds no frame, so every panel comes whole)."""
    return (grid_data(at) or {}).get("panels", {})


def metric_card(at: AppTest, label: str) -> dict:
    return next(m for m in panels(at)["metrics"]["cards"] if m["label"] == label)


def metric(at: AppTest, label: str) -> str:
    return metric_card(at, label)["value"]


def delta(at: AppTest, label: str) -> str:
    return metric_card(at, label)["delta"]


def html_with(at: AppTest, marker: str) -> str:
    """An HTML element (or a live view's HTML) holding `marker`."""
    p = panels(at)
    live = [p.get("card", ""), p.get("banner", ""), *(p["tables"][k] for k in ("cards", "finished") if "tables" in p)]
    return next(h for h in [*(h.value for h in at.html), *live] if marker in h)


def travel_line(at: AppTest) -> str:
    """The time-travel bar's line: live or travelled, the event, its step."""
    return (panels(at).get("travel") or {}).get("caption") or ""


def press(at: AppTest, c: EngineClient, move: str) -> None:
    """A button of the time-travel bar, as its trigger's callback moves (app/ui/travel.py)."""
    from app.ui import travel
    t = panels(at)["travel"]
    at.session_state["travel"] = travel.destination(move, t["value"], t["first"], t["last"], c.step_edge)
    at.run()


def rerun_until(at: AppTest, cond, timeout: float = 20.0, what: str = "the app to show it"):
    return wait(lambda: cond(at.run()), timeout, what)


def status_line(at: AppTest) -> str:
    """The header's status line (state, source, address): the live views', or the one the page
    shows while it connects."""
    return panels(at).get("status") or next((h.value for h in at.html if "● <b>" in h.value), "")


def show_log(at: AppTest):
    next(c for c in at.segmented_control if c.label == "History").set_value("Event log").run()
    return at.dataframe[0].value


def submit(at: AppTest, text: str, **fields) -> None:
    at.text_area(key="prompt_text").set_value(text)
    for key, value in fields.items():
        (at.toggle if isinstance(value, bool) else at.number_input)(key=key).set_value(value)
    next(b for b in at.sidebar.button if b.label == "Submit").click()
    at.run()


def reset_widget(at: AppTest, key: str):
    """A widget of the reset form: its key is `key@<the pool it starts from>` (app/ui/controls.py)."""
    return next(w for kind in ("select_slider", "number_input", "selectbox", "toggle")
                for w in getattr(at, kind) if w.key and w.key.split("@")[0] == key)


def reset_pool(at: AppTest, **widgets) -> None:
    """Fill the sidebar's reset form (widget key -> value) and press Reset engine."""
    for key, value in widgets.items():
        reset_widget(at, key).set_value(value)
    next(b for b in at.sidebar.button if b.label == "Reset engine").click()
    at.run()


def embedded_tiny_512x8(monkeypatch):
    """The dashboard on its embedded engine (the tiny model) reset to 512 blocks of 8 tokens:
    (the app, the engine's Hosted, the grid's data)."""
    from app.ui.connection import hosted
    for var in ("KVSCOPE_ENGINE", "KVSCOPE_REPLAY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVSCOPE_MODEL", "tiny")
    st.cache_resource.clear()
    at = AppTest.from_file(MAIN, default_timeout=30)
    rerun_until(at, grid_data, 90, "the embedded engine's grid")
    reset_pool(at, reset_bs=8, reset_dev=512)
    data = rerun_until(at, lambda a: (d := grid_data(a)) and (d["n"], d["bs"]) == (512, 8) and d, what="512 x 8")
    return at, hosted("engine.serve.server", ("--model", "tiny", "--port", "0")), data


def card(at) -> str:
    """The lesson card's text: its title line and the stop's caption."""
    md = [m.value for m in at.main.markdown]
    i = next((i for i, m in enumerate(md) if m.startswith("**") and " · stop " in m), None)
    return "" if i is None else "\n".join(md[i:i + 2])


def lesson_button(at, name: str, view: str = "lesson"):
    """A lesson's Next or Back (`view` "fleet_lesson": the fleet lesson's), keyed by the stop it is
    drawn for (app/modes/lessons_view.py)."""
    return next(b for b in at.button if (b.key or "").startswith(f"{view}_{name}@"))


def reached(at, i: int, n: int):
    """Stop i reached, shown, and Next drawn for it (the sidebar draws before the card, so a run
    in which the stop arrives in between shows it reached with Next still disabled)."""
    run = at.session_state["lesson"]
    return (run.pending is None and len(run.reached) == i + 1 and f"stop {i + 1} of {n}" in card(at)
            and (i == n - 1 or not lesson_button(at, "next").disabled))


def start(at, key: str, stops: int) -> None:
    """Lessons mode, `key` picked and started, then Next until `stops` stops were reached."""
    n = len(LESSONS[key].stops)
    at.segmented_control(key="mode").set_value("Lessons").run()
    at.selectbox(key="lesson_pick").set_value(key).run()
    at.button(key="lesson_start").click().run()
    for i in range(stops):
        if i:
            lesson_button(at, "next").click().run()
        rerun_until(at, lambda a: reached(a, i, n), 120, f"{key}: stop {i + 1}")


def check_claims(observer, key: str, i: int, run) -> AtStop:
    """The stop's caption's claims (tests/lesson_claims.py) against the observer's pool at the stop."""
    r = run.reached[i]
    values, fx = run.memo["words"]
    with observer.lock:
        h = observer.history
        state = h.at(r.end).state
        upto = [e for e in h.events if e.seq <= r.end]
        step = h.last_step_events(r.end)
        hit = h.event(r.at) if r.at is not None else None
    reset = max((e.seq for e in upto if isinstance(e, p.Reset)), default=0)
    at = AtStop(state, step, [e for e in upto if e.seq >= reset], values, list(fx.blocks), hit,
                run.reached[i - 1].end if i else None)
    CLAIMS[key, i](at)
    return at


def walk_lesson(at: AppTest, observer: EngineClient, key: str) -> None:
    """Lessons mode, lesson `key` from Start to its last stop with Next alone: at each stop the caption
    filled, the engine paused at an event of the stop's kinds, the grid and the tables ringing its
    blocks, and the caption's claims (tests/lesson_claims.py) true of the pool there."""
    lesson = LESSONS[key]
    n = len(lesson.stops)
    at.segmented_control(key="mode").set_value("Lessons").run()
    at.selectbox(key="lesson_pick").set_value(key).run()
    at.button(key="lesson_start").click().run()
    stops = []
    for i, stop in enumerate(lesson.stops):
        if i:
            lesson_button(at, "next").click().run()
        rerun_until(at, lambda a: reached(a, i, n), 120, f"{key}: stop {i + 1}")
        run = at.session_state["lesson"]
        text = card(at)
        assert not run.errors and not run.notes, (run.errors, run.notes)
        assert "?" not in re.sub(r"`[^`]*`", "", text), text  # every placeholder filled
        assert not re.search(r"\b(\w+) finished\W+\1 finished\b", text), text  # "A and B finished. B finished;"
        assert observer.loop.paused if observer.hello and "loop" in observer.hello.features else True
        data = rerun_until(at, lambda a: grid_data(a), what="the grid")
        blocks = run.memo["words"][1].blocks
        assert data["highlight"] == blocks
        if stop.until:  # the engine stopped at an event of the stop's kinds, in the step shown
            hit = run.reached[i].at
            with observer.lock:
                ev = observer.history.event(hit)
            assert ev is not None and kind_of(ev) in stop.until
            if kind_of(ev) not in ("finish", "cached", "step"):
                assert blocks, f"{key} stop {i + 1} highlights nothing"
        if blocks and data["live"]:
            assert "lit" in html_with(at, 'class="bt"')  # the block tables ring them too
        if stop.panel:  # the stop opens its history panel under the grid
            rerun_until(at, lambda a: next(c for c in a.segmented_control if c.label == "History").value == stop.panel,
                        what=f"the {stop.panel} panel")
        stops.append(check_claims(observer, key, i, run))  # what the caption says, against the pool at the stop
    GOALS[key](lesson, stops)  # what the goal line said the lesson would show
    assert at.session_state["lesson"].done
    assert "End of the lesson" in "\n".join(c.value for c in at.caption)
