"""The dashboard's connection to an engine: a daemon thread that keeps a WebSocket open
(reconnecting on its own), mirrors the event stream into a History, and sends commands.

It never calls st.*: Streamlit sessions read it through `view`, `status` and `reply`.
"""
from __future__ import annotations

import copy
import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection

from kvscope_contract import protocol as p
from kvscope_contract.state import InvariantError
from app.history.event_history import EventHistory
from app.history.mirror import Mirror
from app.link import gate
from app.link.wire import open_ws

ConnState = Literal["connecting", "connected", "reconnecting", "failed", "closed"]
MAX_BACKOFF_S = 5.0
MAX_REPLIES_KEPT = 500  # answers to commands, by id, until the session that sent them reads them
MAX_VIEWS_CACHED = 8    # views (states at an event) shared by every session: live plus a few travelled to
MAX_NOTICES = 50


class NotConnected(RuntimeError):
    pass


@dataclass
class Status:
    state: ConnState = "connecting"
    url: str = ""
    attempts: int = 0          # failed attempts since the last success
    last_error: str = ""
    cause: str = ""            # why the last connection ended (kept while retrying: then last_error is the retry's)
    since: float = field(default_factory=time.time)
    # snapshots that took the place of events: asked for after a gap, or sent by a server this client fell behind
    resyncs: int = 0
    skipped: int = 0  # the events they skipped (their counts come with the snapshot, where the server keeps them)

    def resynced(self) -> str:
        """'resynced 3 times, 1,204 events skipped', or '' when it never was."""
        if not self.resyncs:
            return ""
        return (f"resynced {self.resyncs:,} time{'s' * (self.resyncs != 1)}, "
                f"{self.skipped:,} event{'s' * (self.skipped != 1)} skipped")


@dataclass(frozen=True)
class View:
    """The state at one event number, frozen for drawing."""
    mirror: Mirror
    live: bool
    epoch: int
    step_events: list  # the events of the engine step that the viewed event belongs to
    memo: dict = field(default_factory=dict, compare=False)  # drawings derived from it, computed once

    @property
    def event(self) -> int:
        return self.mirror.last_event

    def block_states(self) -> np.ndarray:
        """Every device block's state (PoolState.block_states), computed once for every panel."""
        if (states := self.memo.get("block_states")) is None:
            states = self.memo["block_states"] = self.mirror.state.block_states()
        return states


@dataclass(frozen=True)
class Redraw:
    """What one redraw of the live page draws, read from the client in one instant: the state
    at one event and what was known then (the retained events, the loop, the connection). Every
    panel of a redraw gets this object and none reads the client, so no two panels can describe
    different moments, however long the redraw takes while events keep arriving."""
    view: View
    first: int                  # the retained events: first..last (live: last is the view's event)
    last: int
    markers: tuple              # the retained timeline markers (Marker), oldest first
    loop: p.LoopState
    status: Status
    hello: p.Hello | None
    url: str
    colors: dict[str, int]      # the client's own: append-only, so every sequence of the view has its colour
    stopped_step: tuple[p.AnyEvent, ...] = ()  # the step of the key event the loop stopped at, when the view shows it

    @property
    def event(self) -> int:
        return self.view.event

    def lane_may_draw(self, *, mode: str, pending: bool, died: bool, restarted: bool) -> bool:
        """The one rule for whether the live views may redraw by their lane (app/panels/lane.py: frames
        composed without a Streamlit rerun, so without the session) after this redraw: only the
        live engine (no time travel), connected and running, in Explore (not a lesson), with no
        command's answer to show, of the process the source runs now. Anything else needs the
        session in its redraw (time travel, a lesson's stops, a paused engine's banner, a command's
        answer, a death or a restart said), which a rerun draws. The rerun that opens the lane, each
        frame the lane composes and the browser (whose `open` is the server's answer) go by this.

        `mode`: the page's mode (Explore, Lessons); `pending`: whether the session has commands sent
        and not yet answered; `died`: whether the engine's process died; `restarted`: whether the
        client drawn is no longer the source's (a restart since, or the history from before one)."""
        return (mode == "Explore" and self.view.live and self.status.state == "connected"
                and not self.loop.paused and not pending and not died and not restarted)


def stopped_step(h: EventHistory, view: View, loop: p.LoopState) -> tuple[p.AnyEvent, ...]:
    """Every event of the step whose key event a run-to-next-key-event stopped at, while the
    engine waits there and `view` shows that step, with no reset (or clean slate) between them;
    empty otherwise. Read once per view: a paused engine's view is redrawn from the cache."""
    at = loop.stopped_at
    if not loop.paused or at is None or at > view.event or h.segment_start(view.event + 1) >= at:
        return ()
    key = ("stopped_step", at)
    if key not in view.memo:
        view.memo[key] = tuple(h.step_events(at))
    return view.memo[key]


class EngineClient:
    PING_INTERVAL_S: float | None = 20.0  # WebSocket keepalive: an engine that answers no ping within
    PING_TIMEOUT_S: float | None = 20.0   # the timeout (a stopped process) is dropped and retried

    def __init__(self, url: str, token: str | None = None, *, max_events: int = 1_000_000):
        self.url, self.token, self.max_events = url, token or None, max_events
        self.lock = threading.RLock()
        self.status = Status(url=url)
        self.hello: p.Hello | None = None
        self.history: EventHistory | None = None
        self.epoch = 0                          # bumps when the history starts over
        self.colors: dict[str, int] = {}        # seq_id -> colour index, in order of appearance
        self.loop = p.LoopState(paused=False, step_delay_ms=0.0)  # the engine loop's pause and pace
        self.notices: deque[tuple[float, str, str]] = deque(maxlen=MAX_NOTICES)  # (time, level, text)
        self.received_at = 0.0                  # wall time of the last event
        self._replies: OrderedDict[int, p.Ack | p.Error] = OrderedDict()
        self._views: OrderedDict[tuple[int, int, bool], View] = OrderedDict()
        self._ids = itertools.count(1)
        self._ws: ClientConnection | None = None
        self._send_lock = threading.Lock()
        self._awaiting_snapshot = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvscope-client {url}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the connection thread
    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                with open_ws(self.url, p.FEATURES, self.token, open_timeout=5, close_timeout=1,
                             ping_interval=self.PING_INTERVAL_S, ping_timeout=self.PING_TIMEOUT_S) as ws:
                    self._ws = ws
                    for frame in ws:
                        self._on_frame(frame)
                    error = ws.close_reason or "the engine closed the connection"
            except InvalidStatus as e:
                code = e.response.status_code
                error = ("the engine refused the token (HTTP 401): check --token" if code == 401
                         else f"the handshake failed with HTTP {code}")
            except InvalidURI as e:
                self._set_state("failed", f"not a WebSocket URL: {e}")
                return
            except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError) as e:
                error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except Exception as e:  # a bug in a handler must not end the thread
                error = f"client error: {type(e).__name__}: {e}"
                self._notice("error", error)
            finally:
                self._ws = None
            if self._stop.is_set():
                return
            with self.lock:
                if self.status.state == "connected":
                    backoff = 0.2
                    self.status.cause = error
                self.status.attempts += 1
                self._on_disconnect(error)
                self._set_state("reconnecting", error)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _on_disconnect(self, error: str) -> None:
        """A connection attempt or a connection ended (under the lock); subclasses count what was lost."""

    def _set_state(self, state: ConnState, error: str) -> None:
        with self.lock:
            if state != self.status.state:
                self.status.since = time.time()
            self.status.state, self.status.last_error = state, error

    def _notice(self, level: str, text: str) -> None:
        self.notices.append((time.time(), level, text))

    def _on_frame(self, frame: str | bytes) -> None:
        try:
            msg = p.decode_server_message(frame)
        except msgspec.DecodeError as e:
            self._notice("error", f"ignored a message the client cannot read: {e}")
            return
        with self.lock:
            match msg:
                case p.Hello():
                    self.hello = msg
                    self.loop = p.LoopState(paused=msg.paused, step_delay_ms=msg.step_delay_ms)
                case p.LoopState():
                    self.loop = msg
                case p.Snapshot():
                    self._on_snapshot(msg)
                case p.Events():
                    self.received_at = time.time()
                    for ev in msg.events:
                        self._on_event(ev)
                case p.Ack() | p.Error():
                    self._on_reply(msg)

    def _on_snapshot(self, snap: p.Snapshot) -> None:
        h = self.history
        if h is None or snap.seq < h.last_event:
            if h is not None:
                self._notice("warning", f"the engine started over (event {snap.seq} after "
                                        f"{h.last_event}): the history starts again")
            self.history, self.epoch = self._new_history(snap), self.epoch + 1
        else:
            if snap.seq > h.last_event or self._awaiting_snapshot:  # events gave way to it
                self.status.resyncs += 1
                self.status.skipped += snap.seq - h.last_event
            h.resync(snap)
        for s in snap.seqs:
            self._color(s.seq_id)
        self._awaiting_snapshot = False
        self._views.clear()
        if self.status.state != "connected":
            self.status.attempts = 0
            self._set_state("connected", "")

    def _new_history(self, snap: p.Snapshot) -> EventHistory:
        return EventHistory(snap, self.max_events)

    def _on_event(self, ev: p.AnyEvent) -> None:
        h = self.history
        if h is None or self._awaiting_snapshot or ev.seq <= h.last_event:
            return  # before the first snapshot, while waiting for a resync, or a duplicate
        if ev.seq != h.last_event + 1:
            return self._resync(f"events {h.last_event + 1}..{ev.seq - 1} are missing")
        try:
            h.append(ev)
        except InvariantError as e:
            return self._resync(f"the mirror rejected an event ({e})")
        if isinstance(ev, (p.RequestAdded, p.Fork)):
            self._color(ev.seq_id)

    def _resync(self, why: str) -> None:
        self._notice("warning", f"{why}: asking the engine for a fresh snapshot")
        self._awaiting_snapshot = True
        try:
            self._send_raw(p.SnapshotCmd(id=next(self._ids)))
        except NotConnected:
            pass  # the next connection starts with a snapshot anyway

    def _on_reply(self, msg: p.Ack | p.Error) -> None:
        if isinstance(msg, p.Error):
            self._notice("error", f"{msg.op or 'command'}: {msg.message}")
        elif self.hello and "loop" not in self.hello.features:  # a server without `loop`: own acks only
            if msg.op in ("pause", "resume"):
                self.loop = msgspec.structs.replace(self.loop, paused=msg.op == "pause")
        if isinstance(msg.id, int):
            self._replies[msg.id] = msg
            while len(self._replies) > MAX_REPLIES_KEPT:
                self._replies.popitem(last=False)

    def _color(self, seq_id: str) -> int:
        return self.colors.setdefault(seq_id, len(self.colors))

    # ------------------------------------------------------------------ commands
    def _send_raw(self, cmd: p.Command) -> None:
        ws = self._ws
        if ws is None or self.status.state != "connected":
            raise NotConnected(f"not connected to {self.url} ({self.status.last_error or self.status.state})")
        with self._send_lock:
            try:
                ws.send(p.encode(cmd).decode())
            except (ConnectionClosed, OSError) as e:
                raise NotConnected(f"the connection to {self.url} dropped: {e}") from None

    def send(self, cmd: p.Command) -> int:
        """Send a command; returns its id, whose answer `reply(id)` gives once it arrives. Raises
        gate.Refused for a session that may not change the engine (a viewer)."""
        gate.check()
        cmd.id = next(self._ids)
        self._send_raw(cmd)
        return cmd.id

    def reply(self, cid: int) -> p.Ack | p.Error | None:
        with self.lock:
            return self._replies.get(cid)

    def wait_reply(self, cid: int, timeout: float = 5.0) -> p.Ack | p.Error | None:
        deadline = time.monotonic() + timeout
        while (r := self.reply(cid)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return r

    # ------------------------------------------------------------------ reading
    @property
    def is_replay(self) -> bool:
        return bool(self.hello and self.hello.replay)

    @property
    def paused(self) -> bool:
        return self.loop.paused

    def supports(self, op: str) -> bool:
        """Whether the server carries out `op` (hello.supports; every op when it does not say)."""
        return self.hello is None or self.hello.supports is None or op in self.hello.supports

    def bounds(self) -> tuple[int, int] | None:
        with self.lock:
            h = self.history
            return (h.first_event, h.last_event) if h else None

    def view(self, n: int | None = None, live: bool | None = None) -> View | None:
        """The state after event n (None: the latest), shared by every session. `live`: whether
        it is drawn as the live state (default: when n is None) or as time travel."""
        with self.lock:
            h = self.history
            if h is None:
                return None
            live = n is None if live is None else live
            n = h.last_event if n is None else max(h.first_event, min(n, h.last_event))
            key = (self.epoch, n, live)
            if (v := self._views.get(key)) is None:
                v = View(h.at(n), live, self.epoch, h.last_step_events(n))
                self._views[key] = v
                while len(self._views) > MAX_VIEWS_CACHED:
                    self._views.popitem(last=False)
            return v

    def redraw(self, n: int | None = None, live: bool | None = None) -> Redraw | None:
        """One redraw's reading of the client (see Redraw): the view of `view(n, live)` with the
        retained events, markers, loop and connection of the same instant."""
        with self.lock:
            view = self.view(n, live)
            if view is None:
                return None
            h = self.history
            return Redraw(view, h.first_event, h.last_event, tuple(h.markers), self.loop, copy.copy(self.status),
                          self.hello, self.url, self.colors, stopped_step(h, view, self.loop))

    def timeline(self, n: int | None = None) -> tuple[list, list]:
        """Step points and markers of the segment holding event n (None: live), up to n."""
        with self.lock:
            h = self.history
            if h is None:
                return [], []
            n = h.last_event if n is None else n
            lo = h.segment_start(n)
            return ([x for x in h.points if lo < x.seq <= n], [x for x in h.markers if lo < x.seq <= n])

    def markers(self) -> list:
        """Every retained timeline marker (preemptions, swaps, resets), oldest first."""
        with self.lock:
            return list(self.history.markers) if self.history else []

    def clean_slate(self) -> int | None:
        """Counters and timeline start afresh from the live event (see EventHistory)."""
        with self.lock:
            if self.history is None:
                return None
            n = self.history.clean_slate()
            self._views.clear()
            return n

    def events_before(self, n: int | None, count: int) -> list[p.AnyEvent]:
        with self.lock:
            h = self.history
            return h.recent(h.last_event if n is None else n, count) if h else []

    def step_edge(self, n: int, forward: bool) -> int:
        with self.lock:
            return self.history.step_edge(n, forward) if self.history else n

    def color(self, seq_id: str) -> int:
        with self.lock:
            return self._color(seq_id)

    def close(self, why: str = "") -> None:
        """Stop for good (the history stays readable); `why` is shown as the last error."""
        self._stop.set()
        self._set_state("closed", why)
        ws = self._ws
        if ws is not None:
            ws.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=3)
