"""What every test against a real vLLM checks a plugin client with: its mirror of the events
against vLLM's own snapshot, and waiting for requests to finish."""
from __future__ import annotations

import json
import time

from integrations.vllm import SNAPSHOT_INTERVAL_S
from kvscope_contract import protocol as p
from tests.protocol_client import Client


def compare_live_snapshot(c: Client, attempts: int = 20) -> int:
    """Ask for a snapshot (vLLM's structures, read between two scheduler calls) and check that
    it equals the client's mirror of the events up to the same event. A snapshot supersedes the
    events still queued for this client (docs/protocol.md), so one that is ahead of the mirror
    cannot be compared: it is taken and asked for again. The mirror is compared before the
    snapshot replaces it (the client's reader would apply it on arrival). Asked no more often than
    the plugin takes them (SNAPSHOT_INTERVAL_S): one asked sooner waits for its turn while vLLM
    steps on, and is always ahead. Returns how many snapshots it asked for."""
    for asked in range(1, attempts + 1):
        time.sleep(max(0.0, getattr(c, "snapshot_asked", 0.0) + 1.5 * SNAPSHOT_INTERVAL_S - time.monotonic()))
        c.snapshot_asked = time.monotonic()
        c.send(op="snapshot", id=f"s{time.monotonic_ns()}")
        c.wire.mirrors = False  # events still apply; the snapshot is compared, then taken
        try:
            msg = c.sync(lambda m: m["type"] == "snapshot")
        finally:
            c.wire.mirrors = True
        live = p.decode_server_message(json.dumps(msg))
        assert live.seq >= c.state.last_event, "a snapshot never goes back in time"
        same = live.seq == c.state.last_event
        if same:
            mirror = c.state.snapshot()
            for a, b in zip(live.device_blocks, mirror.device_blocks):
                assert a == b, f"block {a.id}: vLLM says {a}, the events say {b}"
            assert live.seqs == mirror.seqs and live == mirror
        c.adopt(live)
        if same:
            return asked
    raise AssertionError(f"every one of {attempts} snapshots was ahead of the events received")


def finishes(c: Client, n: int, timeout: float = 300) -> None:
    """Until `n` sequences finished (their `finish` events, or unseen in events a snapshot the
    client took superseded) and none runs (an earlier test's request may still run)."""
    c.until(lambda: c.kinds["finish"] + c.left_unseen >= n and not c.state.seqs, timeout)
