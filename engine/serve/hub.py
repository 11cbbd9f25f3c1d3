"""Fan-out of server messages to WebSocket clients, never waiting on any one of them.

Both the live engine server and the replay of a recording serve through a Hub. Each client
has its own bounded outbox: events go out once per step batch, encoded once; a client whose
outbox overflows drops its queued events and is resynchronised with a fresh snapshot, while
the producer and the other clients go on. Replies (ack, error) are never dropped.
Snapshots take their place in the outboxes at once and are encoded by a worker thread, at
most once per encoding (v1, or `columnar` for clients that asked for it), so a pool of a
million blocks stalls neither the producer nor the loop.
No torch here: a replay must start without it.
"""
from __future__ import annotations

import asyncio
import hmac
import http
import logging
import queue
import socket
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Union
from urllib.parse import parse_qs, urlsplit

import msgspec

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from engine.serve.admission import Admission
from kvscope_contract import protocol as p
from kvscope_contract.access import engine_refusal
from kvscope_contract.state import PoolState

log = logging.getLogger("kvscope")
# The pools at one point of the stream: taken there, turned into frames later, off the loop.
SnapshotSource = Union[p.Snapshot, PoolState, Callable[[], PoolState]]


class Backend(Protocol):
    """What produces the stream: the engine loop, or a recording being replayed."""

    def start(self, hub: Hub) -> None:
        """Begin producing into `hub`; called on the hub's loop once it listens."""

    def stop(self) -> None:
        """Stop producing; called on the hub's loop when serving ends."""

    def hello(self) -> p.Hello: ...

    def request_snapshot(self) -> None:
        """Arrange for `Hub.deliver_snapshot` to be called on the loop, after every event
        published so far and before any later one, with the state at that point (a cheap
        copy: the hub encodes it on a worker thread)."""

    def handle(self, cmd: p.AnyCommand, client: Client) -> None:
        """Carry out a command; answer it with `Hub.reply` (possibly later)."""


EVENTS, SNAPSHOT, REPLY = "events", "snapshot", "reply"
METRICS_PATH = "/metrics"  # answered over plain HTTP on the WebSocket port when the hub has metrics
TOKENIZE_PATH = "/tokenize"  # GET ?prompt=TEXT: {"tokens": [...], "count": n}, as the engine tokenizes a plain prompt
CLOSE_TIMEOUT_S = 1.0  # a peer that does not answer the closing handshake sooner is dropped
THREAD_WAIT_S = 30.0   # serve_in_thread: for the server to listen, and for it to stop
PACING_COMMANDS = ("pause", "resume", "step", "pace", "run_until")  # what Pacing carries out


@dataclass
class Pacing:
    """Pause, single steps, pace and run-until, for whatever produces the stream (the engine
    loop or a replay). `changed` is set whenever what `state()` reports changes."""
    paused: bool = False
    steps_allowed: int = 0  # steps granted while paused
    step_delay_ms: float = 0.0
    until: frozenset[str] = frozenset()  # run_until: pause after a step with one of these kinds
    until_steps_left: int = 0
    stopped_at: int | None = None
    changed: bool = False

    def handle(self, cmd: p.AnyCommand) -> bool:
        """Carry out a pacing command; False for any other command."""
        match cmd:
            case p.Pause():
                self.paused, self.until = True, frozenset()
            case p.Resume():
                self.paused, self.steps_allowed, self.until = False, 0, frozenset()
            case p.StepCmd():
                if not self.paused:
                    raise p.CommandError("busy", "the stream is running; pause it before stepping")
                self.steps_allowed += cmd.count
            case p.Pace():
                self.step_delay_ms = cmd.step_delay_ms
            case p.RunUntil():
                self.paused, self.steps_allowed = False, 0
                self.until, self.until_steps_left = frozenset(cmd.kinds), cmd.max_steps
            case _:
                return False
        self.stopped_at = None
        self.changed = True
        return True

    @property
    def may_step(self) -> bool:
        return not self.paused or self.steps_allowed > 0

    def stepped(self, events: list[p.Event]) -> None:
        """After a step (or a replayed batch) with `events`: count it, and end a run_until."""
        self.steps_allowed = max(0, self.steps_allowed - 1)
        if not self.until:
            return
        self.until_steps_left -= 1
        hit = next((ev.seq for ev in events if ev.__struct_config__.tag in self.until), None)
        if hit is not None or self.until_steps_left <= 0:
            self.paused, self.until, self.stopped_at, self.changed = True, frozenset(), hit, True

    def state(self) -> p.LoopState:
        return p.LoopState(paused=self.paused, step_delay_ms=self.step_delay_ms, until=sorted(self.until),
                           stopped_at=self.stopped_at)

    def take_change(self) -> p.LoopState | None:
        """The new state if it changed since the last call (to broadcast it), else None."""
        if not self.changed:
            return None
        self.changed = False
        return self.state()

    def stamp(self, hello: p.Hello) -> p.Hello:
        return msgspec.structs.replace(hello, paused=self.paused, step_delay_ms=self.step_delay_ms)


class SnapshotJob:
    """One snapshot on its way to clients: encoded once per encoding, on the hub's worker."""

    def __init__(self, source: SnapshotSource, counters: p.Counters | None = None):
        self.source = source
        self.counters = counters  # the backend's tally at this point, sent with it
        self.frames: dict[bool, asyncio.Future] = {}

    def state(self) -> PoolState:
        if callable(self.source):
            self.source = self.source()
        return PoolState.from_snapshot(self.source) if isinstance(self.source, p.Snapshot) else self.source

    def encode(self, columnar: bool) -> bytes:
        if isinstance(self.source, p.Snapshot) and not columnar:
            snap = self.source
        else:
            state = self.state()
            snap = state.columnar_snapshot() if columnar else state.snapshot()
        if self.counters is not None:
            snap = msgspec.structs.replace(snap, counters=self.counters)
        return p.encode_snapshot(snap)

    def frame(self, columnar: bool, loop: asyncio.AbstractEventLoop, worker: ThreadPoolExecutor) -> asyncio.Future:
        if columnar not in self.frames:
            self.frames[columnar] = loop.run_in_executor(worker, self.encode, columnar)
        return self.frames[columnar]


@dataclass(eq=False)
class Client:
    ws: ServerConnection
    features: frozenset[str] = frozenset()  # optional features granted at connect (`?features=`)
    outbox: deque[tuple[str, bytes | SnapshotJob]] = field(default_factory=deque)  # (kind, frame)
    queued_events: int = 0
    synced: bool = False  # False while waiting for a snapshot: events are not queued meanwhile
    wants_snapshot: bool = False  # asked for once the writer is idle: a stalled client costs nothing
    sending: bool = False
    resyncs: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, frame: bytes | SnapshotJob, kind: str = REPLY) -> None:
        self.outbox.append((kind, frame))
        self.queued_events += kind == EVENTS
        self.wake.set()

    def drop_stale(self) -> None:
        """Queued events and snapshots are superseded by the next snapshot; replies stay."""
        self.outbox = deque(item for item in self.outbox if item[0] == REPLY)
        self.queued_events = 0


class Hub:
    def __init__(self, backend: Backend, *, token: str | None = None, view_token: str | None = None,
                 max_queued_events: int = 256,
                 send_buffer: int = 64 * 1024, record: Path | None = None,
                 metrics: Callable[[str | None], tuple[bytes, str]] | None = None,
                 tokenize: Callable[[str], list[int]] | None = None,
                 tokenize_chat: Callable[[list[dict]], list[int]] | None = None,
                 admission: Admission | None = None):
        self.backend = backend
        self.admission = admission  # how fast new connections get in (None: as fast as they come)
        self.token = token  # required of every client (None: none, on loopback)
        self.view_token = view_token  # with a token: one that views (events, /metrics), never commands
        self._viewing_only: weakref.WeakSet[ServerConnection] = weakref.WeakSet()
        self.metrics = metrics  # GET /metrics: (Accept header) -> (body, content type), off the loop
        self.tokenize = tokenize  # GET /tokenize: a prompt's token ids (the fleet page scores prompts with them)
        self.tokenize_chat = tokenize_chat  # GET /tokenize?messages=JSON: a chat's, with the chat template
        self.max_queued_events = max_queued_events
        self.send_buffer = send_buffer  # a small kernel buffer, so a client that stalls is noticed
        self.clients: set[Client] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="kvscope-snapshots")
        self._recording = open(record, "ab") if record else None
        self._record_snapshot = record is not None  # the recording starts with hello + snapshot

    # ------------------------------------------------------------------ producer side (loop thread)
    def call(self, fn, *args: Any) -> None:
        """Run `fn(*args)` on the hub's loop; safe from any thread, never blocks."""
        self.loop.call_soon_threadsafe(fn, *args)

    def publish_events(self, events: list[p.Event]) -> None:
        frame = p.encode(p.Events(events=events))
        self._record(frame)
        for c in self.clients:
            if not c.synced:
                continue
            if c.queued_events >= self.max_queued_events:
                self._resync(c)  # it fell behind: its queued events are stale, a snapshot replaces them
            else:
                c.push(frame, EVENTS)

    def deliver_snapshot(self, source: SnapshotSource, everyone: bool = False,
                         counters: p.Counters | None = None) -> None:
        """The state after every event published so far, to the clients waiting for one
        (everyone: to all); it takes its place in their outboxes now and is encoded later.
        `counters`: the backend's tally of the events so far (`StreamCounter`), where it keeps one:
        a client that skipped events to this snapshot takes their counts from it."""
        job = SnapshotJob(source, counters)
        if (everyone or self._record_snapshot) and self._recording:
            frame = job.encode(columnar=False)  # in stream order: only when recording
            self._record(frame)
            self._record_snapshot = False
            job.frames[False] = self.loop.create_future()  # v1 clients send the same bytes
            job.frames[False].set_result(frame)
        for c in self.clients:
            if everyone or not c.synced:
                c.push(job, SNAPSHOT)
                c.synced = True

    def reply(self, client: Client, msg: p.Ack | p.Error) -> None:
        if client in self.clients:
            client.push(p.encode(msg))

    def broadcast_loop(self, state: p.LoopState) -> None:
        """Feature `loop`: the loop's pause and pace, to every client that asked for them."""
        frame = p.encode(state)
        for c in self.clients:
            if "loop" in c.features:
                c.push(frame)

    def _resync(self, c: Client) -> None:
        c.drop_stale()
        c.synced = False
        c.resyncs += 1
        if c.sending or c.outbox:
            c.wants_snapshot = True
        else:
            self.backend.request_snapshot()

    def _record(self, frame: bytes) -> None:
        if self._recording:
            self._recording.write(frame + b"\n")
            self._recording.flush()

    # ------------------------------------------------------------------ connections
    async def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        """Before the WebSocket handshake: refuse a web page, a foreign Host or a wrong token
        (kvscope_contract/access.py); answer GET /metrics and GET /tokenize over HTTP. With an
        admission, each waits its turn first, or is refused when its turn is too far off."""
        if self.admission is not None and not await self.admission.admit():
            return conn.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections at once: try again in a "
                                "few seconds\n")
        if why := engine_refusal(request.headers.get("Origin"), request.headers.get("Host"), self.token is not None):
            return conn.respond(http.HTTPStatus.FORBIDDEN, why + "\n")
        if refused := self._check_token(conn, request):
            return refused
        url = urlsplit(request.path)
        if self.tokenize and url.path == TOKENIZE_PATH:
            query = parse_qs(url.query)
            prompt, messages = query.get("prompt", [""])[0], query.get("messages", [""])[0]
            if messages and self.tokenize_chat:
                try:  # a chat as `submit` sends it: [{"role": ..., "content": ...}, ...]
                    chat = msgspec.json.decode(messages, type=list[p.ChatMessage])
                except msgspec.DecodeError as e:
                    return conn.respond(http.HTTPStatus.BAD_REQUEST, f"messages must be a JSON list of "
                                        f"{{role, content}}: {e}\n")
                if not chat or sum(len(m.content) for m in chat) > p.MAX_TEXT_CHARS:
                    return conn.respond(http.HTTPStatus.BAD_REQUEST, f"give 1 or more messages, up to "
                                        f"{p.MAX_TEXT_CHARS} characters in all\n")
                chat = [{"role": m.role, "content": m.content} for m in chat]
                tokens = await asyncio.to_thread(self.tokenize_chat, chat)
            elif not prompt or len(prompt) > p.MAX_TEXT_CHARS:
                return conn.respond(http.HTTPStatus.BAD_REQUEST,
                                    f"give ?prompt=TEXT, 1 to {p.MAX_TEXT_CHARS} characters\n")
            else:
                tokens = await asyncio.to_thread(self.tokenize, prompt)
            response = conn.respond(http.HTTPStatus.OK,
                                    msgspec.json.encode({"tokens": tokens, "count": len(tokens)}).decode())
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = "application/json"
            return response
        if self.metrics and url.path == METRICS_PATH:
            body, content_type = await asyncio.to_thread(self.metrics, request.headers.get("Accept"))
            response = conn.respond(http.HTTPStatus.OK, body.decode())
            del response.headers["Content-Type"]  # Headers keeps every value set: replace, not add
            response.headers["Content-Type"] = content_type
            return response
        return None

    def _check_token(self, conn: ServerConnection, request: Request) -> Response | None:
        if self.token is None:
            return None
        given = parse_qs(urlsplit(request.path).query).get("token", [""])[0]
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth.removeprefix("Bearer ")
        if hmac.compare_digest(given.encode(), self.token.encode()):
            return None
        if self.view_token and hmac.compare_digest(given.encode(), self.view_token.encode()):
            self._viewing_only.add(conn)
            return None
        return conn.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong token\n")

    async def _handler(self, ws: ServerConnection) -> None:
        ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                          self.send_buffer)
        asked = parse_qs(urlsplit(ws.request.path).query).get("features", [""])[0].split(",")
        client = Client(ws, frozenset(f for f in asked if f in p.FEATURES))
        hello = msgspec.structs.replace(self.backend.hello(), features=sorted(client.features))
        client.push(p.encode(hello))
        self.clients.add(client)
        self.backend.request_snapshot()
        writer = asyncio.create_task(self._write(client))
        try:
            async for frame in ws:
                try:
                    cmd = p.parse_command(frame)
                except p.CommandError as e:
                    self.reply(client, e.to_message())
                    continue
                if isinstance(cmd, p.SnapshotCmd):
                    self.reply(client, p.Ack(op="snapshot", id=cmd.id))
                    self._resync(client)
                    continue
                if ws in self._viewing_only:
                    self.reply(client, p.Error(code="unsupported", message="this token only views: commands "
                                               "need the server's token", op=cmd.__struct_config__.tag, id=cmd.id))
                    continue
                try:
                    self.backend.handle(cmd, client)
                except p.CommandError as e:
                    e.op, e.id = cmd.__struct_config__.tag, cmd.id
                    self.reply(client, e.to_message())
        except ConnectionClosed:
            pass
        finally:
            self.clients.discard(client)
            writer.cancel()

    async def _write(self, client: Client) -> None:
        try:
            while True:
                await client.wake.wait()
                client.wake.clear()
                while client.outbox:
                    kind, frame = client.outbox.popleft()
                    client.queued_events -= kind == EVENTS
                    client.sending = True
                    if isinstance(frame, SnapshotJob):
                        try:
                            frame = await frame.frame("columnar" in client.features, self.loop, self.worker)
                        except Exception:  # the client asks again when the next events do not follow
                            log.exception("a snapshot could not be encoded")
                            client.sending = False
                            continue
                    await client.ws.send(frame, text=True)
                    client.sending = False
                if client.wants_snapshot:
                    client.wants_snapshot = False
                    self.backend.request_snapshot()
        except ConnectionClosed:
            pass

    async def serve(self, host: str, port: int, ready=None, stop: asyncio.Future | None = None) -> None:
        """Serve until `stop` resolves: start the backend once listening, then call `ready(port)`."""
        self.loop = asyncio.get_running_loop()
        if self._recording:
            self._record(p.encode(self.backend.hello()))
        async with serve(self._handler, host, port, compression=None, max_size=p.MAX_FRAME_BYTES,
                         close_timeout=CLOSE_TIMEOUT_S, process_request=self._process_request) as server:
            bound = server.sockets[0].getsockname()[1]
            self.backend.start(self)
            if self._recording:
                self.backend.request_snapshot()
            if ready:
                ready(bound)
            try:
                await (stop if stop is not None else asyncio.Future())
            finally:
                self.backend.stop()
                self.worker.shutdown(wait=False, cancel_futures=True)
        if self._recording:
            self._recording.close()


@dataclass
class Serving:
    """A hub serving from a background thread (tests, benchmarks, the vLLM plugin)."""
    url: str
    hub: Hub
    thread: threading.Thread
    request_stop: Any  # () -> None, safe from any thread

    @property
    def backend(self) -> Backend:
        return self.hub.backend

    def stop(self) -> None:
        """Stop serving (the backend too) and wait for the thread."""
        if self.thread.is_alive():
            self.request_stop()
            self.thread.join(timeout=THREAD_WAIT_S)


def serve_in_thread(hub: Hub, host: str = "127.0.0.1", port: int = 0) -> Serving:
    """Serve `hub` from a new daemon thread; returns once it listens (port 0: a free one)."""
    box: queue.Queue = queue.Queue()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        request_stop = lambda: loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))
        await hub.serve(host, port, lambda bound: box.put(Serving(
            f"ws://{host}:{bound}/", hub, threading.current_thread(), request_stop)), stop)

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # a port in use: say so to the caller, not to a dead thread
            box.put(e)

    threading.Thread(target=run, name="kvscope-hub", daemon=True).start()
    out = box.get(timeout=THREAD_WAIT_S)
    if isinstance(out, BaseException):
        raise out
    return out
