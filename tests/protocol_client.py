"""The tests' protocol client: the one reader of the wire (app/link/wire.py's WireClient, which
mirrors the pool as the dashboard does) with each message also as the JSON the server sent, so
the tests check the wire format itself."""
from __future__ import annotations

import json
import time

import msgspec

from kvscope_contract import protocol as p
from app.history.mirror import Mirror
from app.link.wire import WireClient


def pool_of(msg: dict) -> p.Snapshot:
    """A snapshot as sent, less the server's counters: the pool alone, as a mirror's `snapshot()` has it."""
    return msgspec.structs.replace(p.decode_server_message(json.dumps(msg)), counters=None)


class Client:
    """Commands go out as the JSON a user would type; messages come back as dicts, applied to the
    mirror on the way (`state`, `kinds`, `events`)."""

    def __init__(self, url: str, **options):
        self.wire = WireClient(url, **options)
        self.ws = self.wire.ws
        self.hello = json.loads(self.wire.frame)
        assert self.hello["type"] == "hello"
        self.replies: list[dict] = []
        self.snapshots = 0
        self.snapshot: dict | None = None   # the last snapshot, as sent
        self.types: list[str] = []          # the type of every message read, in order
        self.events: list[p.AnyEvent] = []  # every event applied, in order
        self.left_unseen = 0                # sequences that ended in events a snapshot superseded
        self.sync(lambda m: m["type"] == "snapshot")

    @property
    def state(self):
        return self.wire.state

    @property
    def kinds(self):
        return self.wire.kinds

    def recv(self, timeout: float = 30) -> dict:
        """The next message, as sent, once the mirror has applied it and `take` has seen it."""
        before = set(self.state.seqs) if self.state is not None else set()
        msg = self.wire.read(timeout=timeout)
        if isinstance(msg, p.Snapshot) and self.wire.mirrors:
            self._superseded(before, msg)
        if isinstance(msg, p.Events):
            self.events += msg.events
            if msg.events:
                self.last_event = msg.events[-1]
        raw = json.loads(self.wire.frame)
        self.take(raw)
        return raw

    def adopt(self, snap: p.Snapshot) -> None:
        """Take a snapshot read with the mirror off (a test compared it first) as the mirror."""
        self._superseded(set(self.state.seqs), snap)
        self.wire.mirror = Mirror.from_snapshot(snap)

    def _superseded(self, before: set[str], snap: p.Snapshot) -> None:
        """A snapshot supersedes the events still queued for this client, which are never sent: a
        sequence that ended among them ended unseen."""
        self.left_unseen += len(before - {s.seq_id for s in snap.seqs})

    def take(self, msg: dict) -> None:
        """Note a message as sent (a test may wrap this to see every one)."""
        self.types.append(msg["type"])
        if msg["type"] == "snapshot":
            self.snapshots += 1
            self.snapshot = msg
        elif msg["type"] != "events":
            self.replies.append(msg)

    def send(self, **cmd) -> None:
        self.ws.send(json.dumps(cmd))

    def sync(self, until, timeout: float = 60) -> dict:
        """Read and apply messages until `until(message)` holds; returns that message."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(timeout=max(0.01, deadline - time.monotonic()))
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
                self.recv(timeout=0.2)
            except TimeoutError:
                pass

    def request(self, **cmd) -> dict:
        """Send a command and wait for its ack or error (applying events meanwhile)."""
        cmd.setdefault("id", f"c{time.monotonic_ns()}")
        self.send(**cmd)
        return self.sync(lambda m: m["type"] in ("ack", "error") and m.get("id") == cmd["id"])

    def resync(self, timeout: float = 60) -> dict:
        """Ask for a snapshot and read until it comes; that snapshot, as sent."""
        self.request(op="snapshot")
        return self.sync(lambda m: m["type"] == "snapshot", timeout)

    def finished(self, seq_id: str):
        return lambda m: m["type"] == "events" and any(
            e["kind"] == "finish" and e["seq_id"] == seq_id for e in m["events"])

    def close(self) -> None:
        self.ws.close()
