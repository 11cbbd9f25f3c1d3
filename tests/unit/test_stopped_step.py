"""The key event a run-to-next-key-event stopped at is read into the Redraw with the view, so the
banner that explains it reads no client (Redraw's promise): present exactly while the engine waits
there and the view shows its step."""
from __future__ import annotations

from kvscope_contract import protocol as p
from app.derived.key_events import KEY_KINDS, kind_of
from app.link.client import stopped_step
from tests.histories import busy_history, view_at


def a_key_event(h) -> int:
    return next(ev.seq for ev in h.recent(h.last_event, 10_000) if kind_of(ev) in KEY_KINDS)


def test_a_paused_stop_carries_its_whole_step_into_the_redraw():
    h, _ = busy_history()
    at = a_key_event(h)
    step = h.step_events(at)
    end = step[-1].seq
    loop = p.LoopState(paused=True, step_delay_ms=0.0, stopped_at=at)
    got = stopped_step(h, view_at(h, end), loop)
    assert [e.seq for e in got] == [e.seq for e in step] and at in [e.seq for e in got]
    assert stopped_step(h, view_at(h, h.last_event), loop) == tuple(step)  # later views still show it


def test_no_stop_no_step():
    h, _ = busy_history()
    at = a_key_event(h)
    before = view_at(h, at - 1)
    assert stopped_step(h, before, p.LoopState(paused=True, step_delay_ms=0.0, stopped_at=at)) == ()  # not reached
    running = p.LoopState(paused=False, step_delay_ms=0.0, stopped_at=at)
    assert stopped_step(h, view_at(h, h.last_event), running) == ()  # resumed
    assert stopped_step(h, view_at(h, h.last_event), p.LoopState(paused=True, step_delay_ms=0.0)) == ()  # a plain pause
