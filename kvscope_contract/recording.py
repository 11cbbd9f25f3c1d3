"""A recording (`kvscope-engine --record`, JSON lines of server messages) read back: its hello,
its first snapshot and the event batches after it. The replay server, the lab and the trace
export read recordings through this one reader."""
from __future__ import annotations

from pathlib import Path

import msgspec

from kvscope_contract import protocol as p


class Recording:
    """A recording's messages, read up to the first damaged line (a recording cut short by a
    killed engine ends in half a line): everything whole before it replays, and `damage`
    says which lines were skipped and why."""

    def __init__(self, path: Path):
        messages: list = []
        lines = path.read_bytes().splitlines()
        self.damage = ""
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                messages.append(p.decode_server_message(line))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                last = n == len(lines)
                self.damage = (f"line {n} of {len(lines)} is {'cut short' if last else 'damaged'} ({e})"
                               + ("" if last else f"; lines {n}-{len(lines)} were skipped"))
                break
        hellos = [m for m in messages if isinstance(m, p.Hello)]
        snaps = [i for i, m in enumerate(messages) if isinstance(m, p.Snapshot)]
        if not hellos or not snaps:
            raise ValueError(f"{path} is not a KVScope recording: it needs a hello and a snapshot"
                             + (f" before its damage: {self.damage}" if self.damage else ""))
        self.hello: p.Hello = hellos[0]  # as recorded; a replay server says it replays
        self.start: p.Snapshot = messages[snaps[0]]
        # later snapshots (after a reset) follow from the events: the reducer rebuilds them
        self.batches = [m.events for m in messages[snaps[0]:] if isinstance(m, p.Events) and m.events]
        self.num_events = sum(len(b) for b in self.batches)
