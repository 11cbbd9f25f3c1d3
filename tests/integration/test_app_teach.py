"""The teaching parts of the dashboard under AppTest against a real engine (tiny model): every
lesson run from Start to its last stop with Next only (captions filled, blocks highlighted, the
engine paused where the stop says), Back and forward through stops already reached, the Lab
on a preset and on this session's requests, and the prefix tree and lifetimes panels."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvscope_contract import protocol as p
from tests.lesson_claims import CLAIMS, GOALS
from tests.apptest import (LESSONS, card, events, grid_data, html_with, lesson_button, reached, rerun_until, start,
                           walk_lesson)


def test_captions_name_only_views_the_dashboard_has():
    """A caption that sends the reader to a view, panel or card names one the dashboard draws."""
    root = Path(__file__).resolve().parents[2]  # the app's Python and the page's own script (its tabs)
    ui = "\n".join(f.read_text() for f in [*(root / "app").rglob("*.py"), *(root / "assets").glob("*.js")])
    for key, lesson in LESSONS.items():
        for i, stop in enumerate(lesson.stops):
            for name, _ in re.findall(r'(?:\*\*|")([A-Z][\w ]+?)(?:\*\*|")\s+(view|panel|card|tab)\b', stop.caption):
                assert f'"{name}"' in ui or f"<b>{name}</b>" in ui or f">{name}</button>" in ui, \
                    f"{key} stop {i + 1}: no view named {name!r}"
            assert not re.search(r"\(\w+ panel\)", stop.caption), f"{key} stop {i + 1}: {stop.caption}"


def test_a_stop_opens_only_history_panels_the_dashboard_has():
    from app.panels.history_panels import HISTORY_PANELS
    panels = {stop.panel for lesson in LESSONS.values() for stop in lesson.stops} - {""}
    assert panels and panels <= set(HISTORY_PANELS)


def test_every_stop_of_every_lesson_has_its_claims_checked():
    assert set(CLAIMS) == {(key, i) for key, lesson in LESSONS.items() for i in range(len(lesson.stops))}
    assert set(GOALS) == set(LESSONS)  # and every goal line


@pytest.mark.parametrize("key", [k for k, lesson in LESSONS.items() if not lesson.model])
def test_every_lesson_runs_to_its_end_with_next_alone(at, observer, key):
    walk_lesson(at, observer, key)  # a lesson on a hybrid model: tests/integration/test_app_hybrid.py


def test_back_travels_to_a_stop_already_reached_and_next_returns(at, observer):
    start(at, "01_block_tables", 2)
    first_end = at.session_state["lesson"].reached[0].end
    lesson_button(at, "back").click().run()
    data = rerun_until(at, lambda a: (d := grid_data(a)) and not d["live"] and d, what="time travel")
    assert data["seq"] == first_end and "stop 1 of 5" in card(at) and "reached earlier" in card(at)
    run = at.session_state["lesson"]  # the same click delivered again (a fragment's run and the page's)
    assert run.back(seen=1) == first_end and run.next(None, seen=1) == first_end and run.viewing == 0
    before = observer.history.last_event
    lesson_button(at, "next").click().run()  # back to the stop reached last: nothing runs again
    rerun_until(at, lambda a: "stop 2 of 5" in card(a), what="stop 2 again")
    assert observer.history.last_event == before and len(at.session_state["lesson"].reached) == 2
    at.button(key="lesson_restart").click().run()  # starts over: reset, submit, stop 1
    rerun_until(at, lambda a: reached(a, 0, 5), 60, "stop 1 after a restart")
    assert any(isinstance(e, p.Reset) for e in observer.history.events if e.seq > before)


def test_the_lab_runs_a_preset_and_this_sessions_requests(at, observer):
    at.segmented_control(key="mode").set_value("Lab").run()
    at.multiselect(key="lab_bs").set_value([4, 64]).run()
    at.button(key="lab_run").click().run(timeout=120)
    table = at.dataframe[0].value
    assert list(table["block_size"]) == [4, 64] and table["slot_util"][0] > table["slot_util"][1]
    assert len(at.get("image")) == 2  # each pool at its peak
    # this session's requests: one prompt through the engine, then the lab on it at two pool sizes
    at.segmented_control(key="mode").set_value("Explore").run()
    at.text_area(key="prompt_text").set_value("A prompt for the lab to replay.")
    at.number_input(key="prompt_max").set_value(12)
    next(b for b in at.sidebar.button if b.label == "Submit").click().run()
    rerun_until(at, lambda a: events(observer, "finish"), 60, "the request to finish")
    at.segmented_control(key="mode").set_value("Lab").run()
    at.radio(key="lab_source").set_value("This session's requests").run()
    at.multiselect(key="lab_bs").set_value([16]).run()
    at.text_input(key="lab_blocks").set_value("8,256").run()
    at.button(key="lab_run").click().run(timeout=120)
    table = at.dataframe[0].value
    assert list(table["device_blocks"]) == [8, 256] and (table["finished"] >= 1).all()
    assert not [e for e in at.error]


def test_prefix_tree_and_lifetimes_panels_follow_the_engine(at, observer):
    start(at, "04_prefix_caching", 2)
    next(c for c in at.segmented_control if c.label == "History").set_value("Prefix tree").run()
    tree = html_with(at, 'class="pt"')
    hits = [e for e in events(observer, "prefix_hit")]
    assert hits and f"block {hits[-1].block_id}" in tree and "hits" in tree
    assert 'class="tx"' in tree and "KVScope" in tree  # cached blocks labelled with their tokens' text
    next(c for c in at.segmented_control if c.label == "History").set_value("Lifetimes").run()
    text = "\n".join(m.value for m in at.markdown)
    assert "block lifetime" in text and "Blocks held per request" in text
