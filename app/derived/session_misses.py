"""Why the prefix cache missed, over what this dashboard has seen (kvscope_contract/misses.py),
and what would have hit: this session's requests replayed through the lab in the background.

`explained(client)` follows the client's history as events arrive (one explainer per client, so
the live view costs only the new events); a stream whose requests carry no prompt token ids (an
old recording, like the bundled demo) is folded again from the first retained event with the
prompts rebuilt from its block hashes (kvscope_contract/rebuild.py), whenever it has grown.
`what_if(client, since, requests)` returns the latest lab replay of the requests after `since` (the
segment shown: a reset or a clean slate starts another) and starts the next one in a thread when the
session has more requests than the last one covered.
"""
from __future__ import annotations

import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from kvscope_contract import protocol as p
from kvscope_contract.lab import what_if_lines
from kvscope_contract.misses import ExplainedPool, MissExplainer
from kvscope_contract.rebuild import known_prompt, with_rebuilt_prompts
from app.link.lab_run import run_lab, session_recording

KEEP = 100_000  # admissions kept per client


@dataclass
class Explained:
    pool: ExplainedPool
    epoch: int
    first: int          # the first retained event it started from
    rebuilt: int = 0    # prompts rebuilt from block hashes (0: every prompt's token ids were on the stream)


@dataclass
class _Follow:
    lock: threading.Lock = field(default_factory=threading.Lock)
    now: Explained | None = None


_follows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> _Follow


def explained(client, since: int | None = None) -> Explained | None:
    """The explainer over the client's history after event `since` (None: from the first event it
    retains) up to its latest event (None before any). It keeps following from where it started,
    and starts again earlier only when asked for an earlier `since` (time travel to an older segment)."""
    f = _follows.setdefault(client, _Follow())
    with f.lock:
        bounds = client.bounds()
        if bounds is None:
            return None
        first, last = bounds
        start = first if since is None else max(first, min(since, last))
        x = f.now
        if x is None or x.epoch != client.epoch or x.first < first or x.first > start or x.pool.last_event > last:
            x = f.now = _start(client, start)
        if x.pool.last_event == last:
            return x
        new = client.events_before(last, last - x.pool.last_event)
        if x.rebuilt or any(isinstance(e, p.RequestAdded) and not known_prompt(e) for e in new):
            x = f.now = _refold(client, x.first, last)
            return x
        for ev in new:
            if ev.seq == x.pool.last_event + 1:
                x.pool.apply(ev)
        if x.pool.last_event < last:  # a gap (a resync): from the state there on
            x = f.now = _start(client, last)
        return x


def _start(client, n: int) -> Explained:
    state = client.view(n).mirror.state
    return Explained(ExplainedPool.from_state(state, keep=KEEP), client.epoch, n)


def _refold(client, first: int, last: int) -> Explained:
    """Every retained event again, the prompts the stream did not carry rebuilt from block hashes."""
    start = client.view(first).mirror.state
    events = [e for e in client.events_before(last, last - first) if e.seq > first]
    events, rebuilt = with_rebuilt_prompts(start.snapshot(), events)
    x = Explained(ExplainedPool.from_state(start, keep=KEEP), client.epoch, first, rebuilt)
    for ev in events:
        if ev.seq != x.pool.last_event + 1:
            break
        x.pool.apply(ev)
    return x


def admissions_between(x: MissExplainer, after: int, upto: int) -> list:
    """The admissions that began after event `after` and ended by event `upto`."""
    return [a for a in x.admissions if after < a.event <= upto]


def admissions_of(client, after: int, upto: int) -> list:
    """The admissions between two events of the client's history, folded for the purpose from the
    state at `after` (a lesson's stop: from its reset, not from the start of a long history)."""
    bounds = client.bounds()
    if bounds is None:
        return []
    after = max(bounds[0], after)
    pool = ExplainedPool.from_state(client.view(after).mirror.state, keep=None)
    events = [e for e in client.events_before(upto, upto - after) if e.seq > after]
    events, _ = with_rebuilt_prompts(pool.state, events)
    for ev in events:
        if ev.seq != pool.last_event + 1:
            break
        pool.apply(ev)
    return admissions_between(pool.explainer, after, upto)


# ------------------------------------------------------------------------------ what would have hit
@dataclass(frozen=True)
class WhatIf:
    """A lab replay of this session's requests at its pool's config and the configs that would
    make more of it hit (engine.lab --what-if)."""
    since: int           # the event after which the requests it replayed came (a reset, a clean slate)
    upto: int            # the last event of the session it replayed
    requests: int
    lines: list[str]
    notes: list[str]
    error: str = ""
    seconds: float = 0.0


@dataclass
class _Runs:
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: WhatIf | None = None
    covered: int = 0        # the requests the session had seen when the last run started
    since: int = -1         # the segment it replays
    finished_at: float = 0.0
    running_since: float | None = None
    epoch: int = -1


_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> _Runs


RERUN_S = 10.0  # a newer replay starts at most this often while requests keep coming


def what_if(client, since: int, requests: int) -> tuple[WhatIf | None, bool]:
    """The latest replay of this session's requests after event `since` (on the pool as it was
    there: a reset or a clean slate starts another), and whether a newer one is running. A run
    starts when the session has seen `requests` requests since then and the last run covered fewer."""
    r = _runs.setdefault(client, _Runs())
    with r.lock:
        if (r.epoch, r.since) != (client.epoch, since):
            if r.running_since is not None:
                return None, True  # the replay of the segment before is still running
            r.done, r.covered, r.epoch, r.since = None, 0, client.epoch, since
        now = time.monotonic()
        stale = r.done is None or (r.covered < requests and now - r.finished_at > RERUN_S)
        if stale and r.running_since is None and requests:
            r.running_since, r.covered = now, requests
            threading.Thread(target=_run, args=(client, r, client.epoch, since), daemon=True,
                             name="kvscope-what-if").start()
        return r.done, r.running_since is not None


def _run(client, r: _Runs, epoch: int, since: int) -> None:
    t0 = time.monotonic()
    bounds = client.bounds()
    upto = bounds[1] if bounds else 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = session_recording(client, Path(tmp), upto, since)
            if path is None:
                result = WhatIf(since, upto, 0, [], [])
            else:
                report = run_lab(str(path), ["--what-if"])
                result = WhatIf(since, upto, report.requests, what_if_lines(report), list(report.notes),
                                seconds=time.monotonic() - t0)
    except Exception as e:  # a failed replay says so in the panel; the dashboard goes on
        result = WhatIf(since, upto, 0, [], [], error=f"{type(e).__name__}: {e}")
    with r.lock:
        r.running_since, r.finished_at = None, time.monotonic()
        if (r.epoch, r.since) == (epoch, since):
            r.done = result
