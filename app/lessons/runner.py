"""Running a lesson over the live engine: Next sends a stop's commands and waits for the engine
to pause there; Back and forward again travel through the stops already reached (the history
keeps them), so a teacher can go back without rerunning anything; Restart starts over.

Every run is a `run_until` (the engine pauses by itself when it gets there): until the stop's
event kinds, or for exactly N steps (until a kind no step emits, at most N steps). The lesson
pauses the engine before its commands, so nothing runs between a reset and the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from kvscope_contract import protocol as p
from app.lessons.lesson import Focus, Lesson, context, focus, recorded
from app.lessons.walk import StopWalk
from app.derived.session_misses import admissions_of

NEVER_IN_A_STEP = "reset"  # a reset happens between steps: `run_until` it = run exactly max_steps steps
IDLE_GIVE_UP_S = 5.0       # a run the engine has no work for ends after this long


@dataclass
class Reached:
    at: int | None   # the event that stopped the run (None: the steps ran out)
    end: int         # the last event of that step: where the stop is viewed


@dataclass
class Pending:
    index: int
    pause_id: int             # the stop's commands go out once the engine acknowledged the pause
    since: int | None = None  # the last event before them: steps are counted from here
    progress_at: int = 0      # the last event seen, and when, to notice an engine with nothing to run
    after: int = 0            # a stop event the stop's `expect` did not hold at: the run went on past it
    progress_t: float = field(default_factory=time.monotonic)


@dataclass
class LessonRun(StopWalk):
    lesson: Lesson
    reached: list[Reached] = field(default_factory=list)
    viewing: int = -1                 # the stop shown (-1: the introduction)
    pending: Pending | None = None
    records: dict[str, tuple[int, dict]] = field(default_factory=dict)  # name -> (stop index, numbers)
    notes: list[str] = field(default_factory=list)  # what went differently from the script
    errors: list[str] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # ids of the commands of the run in progress
    memo: dict = field(default_factory=dict)       # the viewed stop's words, for the views that redraw often

    # ------------------------------------------------------------------ moving
    def next(self, client, seen: int | None = None) -> int | None:
        """Show the next stop: one reached already (returns the event to travel to), or run the
        engine to a new one (returns None: live)."""
        if self.forward(seen):
            self._run(client, len(self.reached))
        return None if self.pending is not None else self.travel_target()

    def back(self, seen: int | None = None) -> int | None:
        """Show the previous stop, as the history kept it."""
        self.backward(seen)
        return self.travel_target()

    def travel_target(self) -> int | None:
        if self.viewing < 0:
            return None
        last = self.viewing == len(self.reached) - 1
        return None if last and self.viewing == len(self.lesson.stops) - 1 else self.reached[self.viewing].end

    def _run(self, client, index: int) -> None:
        """Pause first; `poll` sends the rest once the pause is acknowledged, when every event
        from before it has arrived: steps are then counted from there."""
        self.sent = [client.send(p.Pause())]
        self.pending = Pending(index, self.sent[0])

    def _send_stop(self, client, pend: Pending) -> None:
        stop = self.lesson.stops[pend.index]
        cmds: list[p.Command] = [p.ResetCmd(config=stop.reset)] if stop.reset is not None else []
        cmds += [p.ClearPrefixCache()] if stop.clear_prefix_cache else []
        cmds += [msgspec.structs.replace(s, id=None) for s in stop.submit]  # sending stamps ids on copies
        cmds.append(p.RunUntil(kinds=stop.until, max_steps=stop.max_steps) if stop.until
                    else p.RunUntil(kinds=[NEVER_IN_A_STEP], max_steps=stop.steps))
        pend.since = client.bounds()[1]
        self.sent += [client.send(cmd) for cmd in cmds]

    def poll(self, client) -> bool:
        """Whether the run in progress reached its stop (then it is recorded and shown)."""
        pend = self.pending
        if pend is None:
            return False
        for cid in self.sent:
            r = client.reply(cid)
            if isinstance(r, p.Error) and f"{r.op}: {r.message}" not in self.errors:
                self.errors.append(f"{r.op}: {r.message}")
        if pend.since is None:
            if client.reply(pend.pause_id) is not None:
                self._send_stop(client, pend)
            return False
        stop = self.lesson.stops[pend.index]
        loop, last, now = client.loop, client.bounds()[1], time.monotonic()
        if last != pend.progress_at:
            pend.progress_at, pend.progress_t = last, now
        steps = sum(1 for _ in _steps_after(client, pend.since))
        hit = loop.stopped_at if loop.stopped_at is not None and loop.stopped_at > max(pend.since, pend.after) else None
        ran_out = steps >= (stop.max_steps if stop.until else stop.steps) and loop.paused and not loop.until
        if hit is not None and stop.until and steps < stop.max_steps and self._unmet(client, hit):
            pend.after = hit  # not what the caption says yet: on to the next event of its kinds
            self.sent.append(client.send(p.RunUntil(kinds=stop.until, max_steps=stop.max_steps - steps)))
            return False
        view = client.view()
        idle = now - pend.progress_t > IDLE_GIVE_UP_S and not (view and view.mirror.state.seqs)
        if hit is None and not ran_out and not idle:
            return False
        if stop.until and hit is None:
            self.notes.append(f"stop {pend.index + 1}: no {', '.join(stop.until)} "
                              + ("within its steps" if ran_out else "happened: the engine ran out of work"))
        end = client.step_edge(hit, True) if hit is not None else last
        if unmet := self._unmet(client, end):
            self.notes.append(f"stop {pend.index + 1}: {'; '.join(unmet)}")
        self.reached.append(Reached(hit, end))
        self.viewing = pend.index
        self.pending = None
        if stop.record:
            values, _ = self.words(client)
            self.records[stop.record] = (pend.index, recorded(values))
        return True

    def _unmet(self, client, at: int) -> list[str]:
        """What the pending stop's caption claims that the pool at the end of event `at`'s step does not show."""
        expect = self.lesson.stops[self.pending.index].expect
        if not (expect.finished or expect.running):
            return []
        view = client.view(client.step_edge(at, True))  # the loop message follows the step's events
        return expect.unmet(view.mirror.state) if view else []

    # ------------------------------------------------------------------ what a stop says
    def words(self, client) -> tuple[dict[str, str], Focus]:
        """The placeholder values and the focus of the stop being viewed."""
        r = self.reached[self.viewing]
        stop = self.lesson.stops[self.viewing]
        view = client.view(r.end)
        h = client.history
        step_events = h.last_step_events(r.end) if h else []
        fx = focus(stop, step_events, r.at, view.mirror.state)
        first = step_events[0].seq - 1 if step_events else r.end
        before = client.view(first).mirror if first >= client.bounds()[0] else None
        records = {k: v for k, (i, v) in self.records.items() if i <= self.viewing}
        engine = client.hello.engine if client.hello else None
        admissions = admissions_of(client, h.segment_start(r.end + 1), r.end) if h else []
        return context(fx, view.mirror, before, engine, records, self.lesson.columns, admissions), fx


def _steps_after(client, since: int):
    """The engine steps that ended after event `since` (newest first)."""
    with client.lock:
        points = list(client.history.points) if client.history else []
    for pt in reversed(points):
        if pt.seq <= since:
            return
        yield pt
