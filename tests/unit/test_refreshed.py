"""app/fleet/refreshed.py: a slow value never blocks its reader, and is recomputed when stale."""
from __future__ import annotations

import threading
import time

from app.fleet.refreshed import Refreshed
from tests.waiting import wait


def test_a_reader_gets_the_latest_value_at_once_while_a_slow_one_is_computed():
    gate, calls = threading.Event(), []

    def compute():
        calls.append(1)
        if len(calls) > 1:
            gate.wait(10)  # the second computation is slow
        return len(calls)

    r = Refreshed(compute, min_age_s=0.05, spacing=1.0)
    assert r.get(wait_s=5).value == 1  # the first: waited for
    wait(lambda: r.stale(), 5, "stale")
    t0 = time.monotonic()
    assert r.get().value == 1  # stale: the old value at once, a recomputation under way
    assert r.get().value == 1 and time.monotonic() - t0 < 1
    wait(lambda: len(calls) == 2, 5, "one recomputation")
    time.sleep(0.2)
    r.get()
    assert len(calls) == 2  # never two at once
    gate.set()
    wait(lambda: r.get().value == 2, 5, "the new value")


def test_a_slow_computation_is_spaced_out_and_a_failure_keeps_the_last_value():
    n = [0]

    def compute():
        n[0] += 1
        if n[0] == 3:
            raise ValueError("boom")
        time.sleep(0.1)
        return n[0]

    r = Refreshed(compute, min_age_s=0.0, spacing=10.0)
    first = r.get(wait_s=5)
    assert first.value == 1 and first.took_s >= 0.1
    assert not r.stale(first.at + 0.5) and r.stale(first.at + 10.1 * first.took_s)  # 10x its duration apart
    r.spacing = 0.0
    wait(lambda: r.get().value == 2, 5, "recomputed")
    wait(lambda: r.error == "ValueError: boom", 5, "the failure said")
    assert r.get().value in (2, 4)
