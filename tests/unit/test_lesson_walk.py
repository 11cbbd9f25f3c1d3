"""Next and Back through a lesson's stops (app/lessons/walk.py), as both lesson runs move:
a stop reached is shown again, never rerun; one click moves one stop, even delivered twice."""
from __future__ import annotations

from app.lessons.lesson import all_lessons
from app.lessons.runner import LessonRun, Pending, Reached


def test_next_runs_only_past_the_last_stop_reached_and_one_click_moves_one_stop():
    lesson = all_lessons()[0]
    run = LessonRun(lesson)
    assert run.stop is None and not run.done
    assert run.forward(seen=-1)                     # nothing reached: the first stop is run to
    run.reached += [Reached(None, 10), Reached(None, 20)]
    run.viewing = 1
    assert run.stop is lesson.stops[1] and run.at_latest
    run.backward(seen=1)
    assert run.viewing == 0 and not run.at_latest
    run.backward(seen=1)                            # the same click delivered to a second script run
    assert run.viewing == 0
    assert not run.forward(seen=0) and run.viewing == 1  # reached before: shown, not run
    assert not run.forward(seen=0) and run.viewing == 1  # delivered again: moves nothing
    assert run.forward(seen=1)                      # past the last stop reached: run to the next
    run.pending = Pending(2, pause_id=1)
    assert not run.forward(seen=1) and run.viewing == 1  # a stop in progress: Next waits
    run.backward(seen=1)
    assert run.viewing == 1                         # and so does Back


def test_the_end_of_a_lesson():
    lesson = all_lessons()[0]
    run = LessonRun(lesson, reached=[Reached(None, i) for i in range(len(lesson.stops))], viewing=0)
    assert run.done and not run.at_end
    while not run.forward(seen=run.viewing) and run.viewing < len(lesson.stops) - 1:
        pass
    assert run.at_end and not run.forward(seen=run.viewing)  # nowhere to go


def test_a_lesson_starts_with_no_host_tier_unless_it_asks_for_one():
    """A lesson's first reset is its whole pool: one that names no host tier gets none, so it never
    inherits the engine's (a pool without prefix caching refuses one)."""
    assert {lesson.stops[0].reset.num_offload_blocks for lesson in all_lessons()} == {0}
