"""A protocol client for the tests: it mirrors the pool with the reducer, as the dashboard does."""
from __future__ import annotations

import json
import time
from collections import Counter

from websockets.sync.client import connect

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState


class Client:
    """A protocol client that mirrors the pool with the reducer, as the dashboard does."""

    def __init__(self, url: str, **kw):
        self.ws = connect(url, max_size=None, open_timeout=10, legacy=True, **kw)
        self.hello = self.recv()
        assert self.hello["type"] == "hello"
        self.state = None
        self.kinds: Counter = Counter()
        self.replies: list[dict] = []
        self.snapshots = 0
        self.events: list[p.AnyEvent] = []  # every event applied, in order
        self.sync(lambda m: m["type"] == "snapshot")

    def recv(self, timeout: float = 30) -> dict:
        return json.loads(self.ws.recv(timeout=timeout))

    def send(self, **cmd) -> None:
        self.ws.send(json.dumps(cmd))

    def take(self, msg: dict) -> None:
        if msg["type"] == "snapshot":
            self.state = PoolState.from_snapshot(p.decode_server_message(json.dumps(msg)))
            self.snapshots += 1
        elif msg["type"] == "events":
            for ev in p.decode_server_message(json.dumps(msg)).events:
                self.state.apply(ev)
                self.events.append(ev)
                self.kinds[ev.__struct_config__.tag] += 1
                self.last_event = ev
        else:
            self.replies.append(msg)

    def sync(self, until, timeout: float = 60) -> dict:
        """Read and apply messages until `until(message)` holds; returns that message."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(timeout=max(0.01, deadline - time.monotonic()))
            self.take(msg)
            if until(msg):
                return msg

    def until(self, cond, timeout: float = 60) -> None:
        """Read and apply messages until `cond()` holds (it may hold already, or turn true on the
        server's side after its last message: so it is checked again while none arrives)."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout:.0f} s")
            try:
                self.take(self.recv(timeout=0.2))
            except TimeoutError:
                pass

    def request(self, **cmd) -> dict:
        """Send a command and wait for its ack or error (applying events meanwhile)."""
        cmd.setdefault("id", f"c{time.monotonic_ns()}")
        self.send(**cmd)
        return self.sync(lambda m: m["type"] in ("ack", "error") and m.get("id") == cmd["id"])

    def finished(self, seq_id: str):
        return lambda m: m["type"] == "events" and any(
            e["kind"] == "finish" and e["seq_id"] == seq_id for e in m["events"])

    def close(self) -> None:
        self.ws.close()
