"""A value too slow to compute on the page's own thread, kept fresh by a background thread.

The fleet-wide prefix cache of 64 engines (half a million cached blocks) takes seconds of
Python to merge, count and draw. Computed in a Streamlit fragment, it would hold the session's
script thread (fragments of one session run one at a time) and the cards would stop redrawing
meanwhile. Here a reader gets the latest value at once; a stale one starts one recomputation in
the background. Stale: older than `min_age_s`, and older than `spacing` times the last
computation took, so a slow computation runs at most 1/spacing of the time.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Fresh(Generic[T]):
    value: T
    at: float      # wall time the computation started (what it shows is as of then)
    took_s: float  # how long it took


class Refreshed(Generic[T]):
    def __init__(self, compute: Callable[[], T], min_age_s: float, spacing: float = 3.0):
        self.compute, self.min_age_s, self.spacing = compute, min_age_s, spacing
        self.latest: Fresh[T] | None = None
        self.error: str = ""  # the last computation's failure, if it failed
        self._lock = threading.Lock()
        self._running = False
        self._done = threading.Condition(self._lock)

    def stale(self, now: float | None = None) -> bool:
        f = self.latest
        now = time.time() if now is None else now
        return f is None or now - f.at >= max(self.min_age_s, self.spacing * f.took_s)

    def get(self, wait_s: float = 0.0) -> Fresh[T] | None:
        """The latest value (None before the first); starts a recomputation when stale. The
        first time, waits up to `wait_s` for it (a small fleet's is ready in milliseconds)."""
        with self._lock:
            if self.stale() and not self._running:
                self._running = True
                threading.Thread(target=self._run, name="kvscope-refresh", daemon=True).start()
            if self.latest is None and wait_s > 0:
                self._done.wait_for(lambda: not self._running, timeout=wait_s)
            return self.latest

    def _run(self) -> None:
        t0, wall = time.perf_counter(), time.time()
        try:
            value = self.compute()
        except Exception as e:  # shown by the page; the previous value stays
            with self._lock:
                self.error, self._running = f"{type(e).__name__}: {e}", False
                self._done.notify_all()
            return
        with self._lock:
            self.latest, self.error, self._running = Fresh(value, wall, time.perf_counter() - t0), "", False
            self._done.notify_all()
