"""Waiting in tests, never a bare sleep: for a condition (`wait`), for a value to settle
(`steady`), or for time itself to pass when that is what a test checks (`until_elapsed`)."""
from __future__ import annotations

import time


def wait(cond, timeout: float = 20.0, what: str = "condition"):
    """Poll `cond` until it returns something true; that value, or an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := cond():
            return out
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def steady(value, for_s: float = 0.5, timeout: float = 20.0, what: str = "a steady value"):
    """`value()` once it has stayed the same for `for_s` seconds (a paused engine's last event:
    nothing more arrives)."""
    last, since = value(), time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = value()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= for_s:
            return now
    raise AssertionError(f"timed out waiting for {what}")


def until_elapsed(since: float, seconds: float) -> None:
    """Until `seconds` have passed since the monotonic time `since`, for a test whose input is
    time itself passing (a paused engine's numbers must not follow the wall clock); what is
    waited for to happen goes through `wait`."""
    wait(lambda: time.monotonic() - since >= seconds, seconds + 5, f"{seconds} s to pass")
