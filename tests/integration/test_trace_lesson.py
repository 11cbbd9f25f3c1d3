"""The lesson on real traffic (app/lessons/trace_lesson.py): picked in the Lessons mode, opened in
the Lab, run stop by stop on the bundled slice of Mooncake's conversation trace through real
`python -m engine.lab` children, each caption as filled and true of its sweep and of the trace
(tests/trace_lesson_claims.py), Back showing a stop again without running it."""
from __future__ import annotations

import json

import pytest

from app.lessons.trace_lesson import all_trace_lessons, caption, load
from app.modes import trace_lesson_view
from tests.trace_lesson_claims import TRACE_CLAIMS, TraceAt
from tests.traces import MOONCAKE

LESSONS = {lesson.key: lesson for lesson in all_trace_lessons()}


def test_every_stop_of_the_trace_lessons_has_its_claims_checked():
    assert set(TRACE_CLAIMS) == {(k, i) for k, lesson in LESSONS.items() for i in range(len(lesson.stops))}


def test_the_bundled_slice_is_the_traces_first_thousand_lines_unchanged():
    (lesson,) = LESSONS.values()
    lines = lesson.path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 1000 and all(json.loads(line)["hash_ids"] for line in lines)
    readme = (lesson.path.parent / "README.md").read_text()
    import hashlib
    assert hashlib.sha256(lesson.path.read_bytes()).hexdigest() in readme and "Apache" in readme
    whole = MOONCAKE / "conversation_trace.jsonl"
    if whole.is_file():  # the checkout's copy of the release (../shared): the slice is its head
        with open(whole, "rb") as f:
            assert [next(f) for _ in range(1000)] == lines


@pytest.mark.parametrize("bad, message", [
    ('do = "tier"\nhost_blocks = 0', "needs host_blocks and a `policies` stop before it"),
    ('do = "ceiling"\ncapacities = [10, 20]', "takes one capacity"),
    ('do = "policies"\nfoo = 1', "foo"),
])
def test_a_bad_lesson_file_names_its_fault(tmp_path, bad, message):
    path = tmp_path / "bad.toml"
    path.write_text(f'title = "t"\ngoal = "g"\n[[stops]]\ntitle = "s"\ncaption = "x"\n{bad}\n')
    with pytest.raises(ValueError, match=message):
        load(path)


def card(at) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_the_lesson_opens_in_the_lab_and_runs_to_its_end(at):
    key = "sizing_real_traffic"
    lesson = LESSONS[key]
    at.segmented_control(key="mode").set_value("Lessons").run()
    at.selectbox(key="lesson_pick").set_value("trace:" + key).run()
    assert "runs in the Lab" in "\n".join(c.value for c in at.sidebar.caption)
    at.sidebar.button(key="lesson_trace_open").click().run()
    assert at.session_state["mode"] == "Lab" and at.radio(key="lab_source").value == "Trace"
    assert lesson.goal.split("\n")[0] in card(at)
    at.button(key="trace_lesson_start").click().run()
    run = at.session_state[trace_lesson_view.KEY]
    for i, stop in enumerate(lesson.stops):
        run.wait(300)
        at.run()
        assert not run.errors and run.viewing == i and len(run.sweeps) == i + 1
        assert caption(stop, run.words()) in card(at) and "{" not in caption(stop, run.words())
        TRACE_CLAIMS[(key, i)](TraceAt(lesson, i, run.sweeps, run.words()))
        (chart,) = at.get("vega_lite_chart")
        assert "marked: " in chart.proto.spec and f"{run.sweeps[i].ceiling_hit_tokens / run.sweeps[i].prompt_tokens}" \
            in chart.proto.spec  # the point the stop is about, and the ceiling
        assert any(f"trace:{lesson.path.name}" in c.value or lesson.path.name in c.value for c in at.code)
        if i + 1 < len(lesson.stops):
            at.button(key=f"trace_lesson_next@{i}").click().run()
    assert at.button(key=f"trace_lesson_next@{len(lesson.stops) - 1}").disabled  # the end
    at.button(key=f"trace_lesson_back@{len(lesson.stops) - 1}").click().run()
    assert run.viewing == len(lesson.stops) - 2 and len(run.sweeps) == len(lesson.stops)  # shown again, not rerun
    assert caption(lesson.stops[-2], run.reached[-2]) in card(at)
