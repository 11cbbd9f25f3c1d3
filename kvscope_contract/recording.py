"""A recording (`kvscope-engine --record`, JSON lines of server messages) read back: its hello,
its first snapshot and the event batches after it. The replay server, the lab and the trace
export read recordings through this one reader.

A recording is a file anyone may hand over, so it is read as hostile: streamed a line at a time,
none longer than `max_line_bytes` (a line that never ends costs that much, not the file), every
pool it names within the protocol's bounds (a `hello` claiming a trillion blocks allocates
nothing), and every event applied to the pool as it is read: the first one that is out of order
or cannot follow ends what is read, as a line cut short or damaged does. Everything whole before
it replays, and `damage` says where it stopped and why.
"""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import msgspec

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState

MAX_LINE_BYTES = 256 << 20  # a snapshot of a million-block pool is about 60 MB
COUNT_CHUNK = 1 << 20


def pool_problem(cfg: p.PoolConfig) -> str | None:
    """Why a pool a recording names is beyond what KVScope draws (the bounds a `reset` takes), or None."""
    bounds = (("block_size", 1, p.MAX_BLOCK_SIZE), ("num_device_blocks", 1, p.MAX_DEVICE_BLOCKS),
              ("num_host_blocks", 0, p.MAX_HOST_BLOCKS), ("max_num_seqs", 1, p.MAX_NUM_SEQS))
    for name, lo, hi in bounds:
        if not lo <= (v := getattr(cfg, name)) <= hi:
            return f"{name} {v:,} is outside {lo}..{hi:,}"
    if len(cfg.kv_groups) > p.MAX_KV_GROUPS:
        return f"{len(cfg.kv_groups):,} KV-cache groups (at most {p.MAX_KV_GROUPS})"
    if any(not 0 <= b < cfg.num_device_blocks for b in cfg.reserved_blocks):
        return "a reserved block outside the pool"
    return None


class Recording:
    """A recording's messages, read up to the first damaged line or event (a recording cut short
    by a killed engine ends in half a line): everything whole before it replays, and `damage`
    says where reading stopped and why ("" when the file was read to its end)."""

    def __init__(self, path: Path, max_line_bytes: int = MAX_LINE_BYTES):
        self.damage = ""
        self.hello: p.Hello | None = None
        self.start: p.Snapshot | None = None
        self.batches: list[list[p.AnyEvent]] = []
        self._state: PoolState | None = None
        with open(path, "rb") as f:
            n = 0
            while True:
                line = f.readline(max_line_bytes + 1)
                if not line:
                    break
                n += 1
                if len(line) > max_line_bytes:  # the rest of this line is never read
                    self.damage = (f"line {n} is longer than {max_line_bytes:,} bytes: no recording has such a "
                                   "line; reading stopped there")
                    break
                if not line.strip():
                    continue
                if why := self._take(line):
                    peek = f.read(1)  # nothing after it: the file was cut short there
                    left = _lines_left(peek, f, path)
                    of = f" of {n + left:,}" if left is not None else ""
                    self.damage = f"line {n}{of} is {'damaged' if peek else 'cut short'} ({why})"
                    if peek:
                        self.damage += f"; lines {n}-{n + left:,} were skipped" if left else "; the rest was skipped"
                    break
        if self.hello is None or self.start is None:
            raise ValueError(f"{path} is not a KVScope recording: it needs a hello and a snapshot"
                             + (f" before its damage: {self.damage}" if self.damage else ""))
        self.num_events = sum(len(b) for b in self.batches)

    @property
    def cut_short(self) -> str:
        """A note for a report on this recording ("" when it was whole)."""
        return (f"the recording was cut short: {self.damage}; only its {self.num_events:,} whole events "
                "before that are counted") if self.damage else ""

    def _take(self, line: bytes) -> str | None:
        """Read one message; why it cannot be taken, or None."""
        try:
            msg = p.decode_server_message(line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            return str(e) or type(e).__name__
        match msg:
            case p.Hello() if self.hello is None:
                if why := pool_problem(msg.config):
                    return f"its hello names a pool beyond KVScope's bounds: {why}"
                # a recording names no server to reach: what its engine served from is not this replay's
                self.hello = msgspec.structs.replace(msg, api_url=None)
            case p.Snapshot() if self.start is None:
                if why := pool_problem(msg.config):
                    return f"its snapshot names a pool beyond KVScope's bounds: {why}"
                try:
                    self._state = PoolState.from_snapshot(msg)
                except (ValueError, IndexError, KeyError, TypeError) as e:
                    return f"its snapshot does not describe a pool: {type(e).__name__}: {e}"
                self.start = msg
            case p.Events() if self._state is not None and msg.events:
                state = self._state  # a line that fails is dropped whole, and reading ends there
                for ev in msg.events:
                    if isinstance(ev, p.Reset) and (why := pool_problem(ev.config)):
                        return f"event {ev.seq} resets to a pool beyond KVScope's bounds: {why}"
                    try:
                        state.apply(ev)
                    except ValueError as e:  # InvariantError: out of order, or cannot follow
                        return str(e)
                self.batches.append(msg.events)
        return None  # later hellos and snapshots follow from the events; replies are not the stream's


def _lines_left(peek: bytes, f: BinaryIO, path: Path) -> int | None:
    """The lines from `peek` (the byte after the current line) on, counted in chunks; None for a
    stream that may never end (not a regular file)."""
    if not path.is_file():
        return None
    n, tail = peek.count(b"\n"), peek
    while chunk := f.read(COUNT_CHUNK):
        n, tail = n + chunk.count(b"\n"), chunk
    return n + (bool(tail) and not tail.endswith(b"\n"))
