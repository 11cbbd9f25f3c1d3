"""vLLM's own prefix-cache counters, read from its OpenAI server's /metrics, for the header to show
next to KVScope's hit rate (they count differently: see HELP).

A daemon thread per server polls while a page reads the counters, so no redraw ever waits on
vLLM's HTTP server; it stops once nobody has read them for a while.
"""
from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass

POLL_S = 1.0
IDLE_STOP_S = 30.0
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
HELP = ("vLLM's own prefix_cache_hits / prefix_cache_queries (its /metrics, since vLLM started): tokens "
        "found in the cache over the tokens looked up, counted each time its scheduler looks a waiting "
        "request up, but only for requests never preempted. KVScope's rate counts every admission, "
        "re-admissions after a recompute preemption too (those find their own blocks still cached), "
        "so under preemption KVScope's is higher; vLLM counts re-admissions apart, as preempted hits.")


@dataclass(frozen=True)
class Counters:
    hits: float
    queries: float
    at: float  # wall time read

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def parse(text: str) -> Counters | None:
    """The two counters in Prometheus text, summed over their label sets; None without them."""
    sums = {HITS: 0.0, QUERIES: 0.0}
    seen = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return Counters(sums[HITS], sums[QUERIES], time.time()) if seen else None


class Poller:
    def __init__(self, api_url: str):
        self.url = api_url.rstrip("/") + "/metrics"
        self.latest: Counters | None = None
        self.error = ""
        self._read_at = time.monotonic()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def read(self) -> Counters | None:
        """The latest counters (None until the first poll answers); keeps the poller running."""
        with self._lock:
            self._read_at = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"kvscope-metrics {self.url}", daemon=True)
                self._thread.start()
        return self.latest

    def _run(self) -> None:
        while time.monotonic() - self._read_at < IDLE_STOP_S:
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    self.latest, self.error = parse(r.read().decode()) or self.latest, ""
            except OSError as e:
                self.error = str(e)
            time.sleep(POLL_S)


_pollers: dict[str, Poller] = {}
_pollers_lock = threading.Lock()


def counters(api_url: str) -> Counters | None:
    """vLLM's counters at `api_url` as last polled (shared by every session)."""
    with _pollers_lock:
        poller = _pollers.setdefault(api_url, Poller(api_url))
    return poller.read()
