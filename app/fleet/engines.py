"""A fleet of engines seen at once: named endpoints, each followed on its own thread, each with
the numbers the fleet page shows. No Streamlit here.

Endpoint kinds:
- `kvscope`: a KVScope engine (or `python -m engine.synthetic`), its WebSocket;
- `vllm-plugin`: a vLLM with the KVScope plugin, its WebSocket (with data parallelism rank r
  serves on the plugin's port + r: give `rank`);
- `kv-events`: a ZMQ KV-event stream (vLLM `--kv-events-config`, SGLang, TensorRT-LLM),
  `tcp://HOST:PORT[?replay=tcp://HOST:PORT]`.

Each endpoint has its own client thread (app/link/client.py's EngineClient, or the KV-event
subscriber), so one that stalls or dies never delays another: a WebSocket that drops is marked
down and retried with backoff (up to 5 s apart); reading a row takes only that endpoint's lock.

A fleet file (`--fleet fleet.toml`):

    [[engine]]
    name = "pod-a"
    url = "ws://127.0.0.1:8765"
    kind = "vllm-plugin"            # kvscope (default) | vllm-plugin | kv-events
    api = "http://127.0.0.1:8000"  # optional: its OpenAI server (load generator, /tokenize)
    rank = 0                        # optional: a data-parallel rank (vllm-plugin: port + rank)
"""
from __future__ import annotations

import json
import threading
from collections import deque
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal
from urllib.parse import urlencode, urlsplit, urlunsplit

import numpy as np

from kvscope_contract import protocol as p
from app.fleet import load as fleet_load
from app.link import gate
from app.link.client import EngineClient
from app.history.event_history import EventHistory
from app.history.mirror import Mirror
from app.fleet.content import HASH_PREFIX, ROOT, Content, ContentTracker, content_id
from app.fleet.index import EngineCache, FleetIndex
from integrations.kv_events.decode import MEDIUM_GPU

Kind = Literal["kvscope", "vllm-plugin", "kv-events"]
ENDPOINT_KINDS: tuple[str, ...] = ("kvscope", "vllm-plugin", "kv-events")
FLEET_EVENTS = 2_000  # events each fleet member keeps: the page reads only the live state (Open starts its own client)
FLEET_CHECKPOINT_BYTES = 0  # nor travels in time: the first and the latest checkpoint only, not a pool per 500 events
SILENT_S = 30.0         # a KV-event stream without a batch this long is marked silent
STALL_S = 5.0           # an engine with running requests that sends no event this long is marked stalled
RATE_S = 3.0            # tokens/s: over the engine steps that arrived in the last this many seconds
PREEMPTING_S = 30.0     # an engine stands out as preempting for this long after its last preemption
COUNTED = ("live", "stalled", "silent")  # the states whose caches the fleet's totals count (not down: last seen)


class FleetFileError(ValueError):
    """A fleet file that cannot be read; says where."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    kind: Kind = "kvscope"
    api: str = ""           # its OpenAI server, for the load generator and /tokenize
    rank: int | None = None
    token: str = ""

    @property
    def address(self) -> str:
        """Where to connect: a plugin's data-parallel rank r listens on its port + r."""
        if self.kind != "vllm-plugin" or not self.rank:
            return self.url
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{(parts.port or 80) + self.rank}"))

    def check(self) -> Endpoint:
        if not self.name.strip():
            raise FleetFileError("an engine needs a name")
        if self.kind not in ENDPOINT_KINDS:
            raise FleetFileError(f"{self.name}: kind must be one of {', '.join(ENDPOINT_KINDS)}, got {self.kind!r}")
        scheme = urlsplit(self.url).scheme
        wanted = ("tcp", "ipc") if self.kind == "kv-events" else ("ws", "wss")
        if scheme not in wanted:
            raise FleetFileError(f"{self.name}: a {self.kind} url starts with "
                                 f"{' or '.join(s + '://' for s in wanted)}, "
                                 f"got {self.url!r}")
        return self


def load_fleet(path: str | Path) -> list[Endpoint]:
    """The endpoints of a fleet file, in its order; FleetFileError names what is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise FleetFileError(f"cannot read {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise FleetFileError(f"{path} is not TOML: {e}") from None
    rows = data.get("engine")
    if not isinstance(rows, list) or not rows:
        raise FleetFileError(f"{path}: list the engines as [[engine]] tables with a name and a url")
    out: list[Endpoint] = []
    for i, row in enumerate(rows):
        unknown = set(row) - {"name", "url", "kind", "api", "rank", "token"}
        if unknown or "url" not in row:
            why = f"unknown keys {sorted(unknown)}" if unknown else "no url"
            raise FleetFileError(f"{path}: engine {i + 1}: {why}")
        out.append(Endpoint(str(row.get("name", f"engine-{i + 1}")), str(row["url"]), row.get("kind", "kvscope"),
                            str(row.get("api", "")), row.get("rank"), str(row.get("token", ""))).check())
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise FleetFileError(f"{path}: engine names must differ: {names}")
    return out


def kv_event_sources(api: str, timeout: float = 3.0) -> list[Endpoint] | None:
    """The KV-event endpoint of every data-parallel rank a vLLM server lists at `GET
    /kv_event_sources`, or None when it does not answer there. vLLM 0.32 answers a JSON object
    keyed by rank, each its KV-events config (`endpoint`, `replay_endpoint`, `topic`); newer
    servers a list of {data_parallel_rank, endpoint, replay_endpoint, topic}. A config every rank
    shares is the base one, which vLLM's publisher offsets by the rank; a wildcard host
    (`tcp://*:5557`) becomes the server's host."""
    try:
        with urllib.request.urlopen(api.rstrip("/") + "/kv_event_sources", timeout=timeout) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):
        return None
    if isinstance(body, dict):
        items = [{**cfg, "data_parallel_rank": int(rank)} for rank, cfg in body.items() if isinstance(cfg, dict)]
    elif isinstance(body, list):
        items = [x for x in body if isinstance(x, dict)]
    else:
        return None
    items = [x for x in items if x.get("endpoint") and x.get("enable_kv_cache_events", True)]
    shared = len(items) > 1 and len({x["endpoint"] for x in items}) == 1
    host = urlsplit(api).hostname or "127.0.0.1"

    def where(url: str, rank: int) -> str:
        parts = urlsplit(url.replace("*", host))
        if shared and rank and parts.port:
            parts = parts._replace(netloc=f"{parts.hostname}:{parts.port + rank}")
        return urlunsplit(parts)

    out = []
    for it in sorted(items, key=lambda x: x["data_parallel_rank"] if "data_parallel_rank" in x else 0):
        rank = int(it.get("data_parallel_rank") or 0)
        query = [f"replay={where(str(it['replay_endpoint']), rank)}"] if it.get("replay_endpoint") else []
        query += [f"topic={it['topic']}"] if it.get("topic") else []
        out.append(Endpoint(f"{host}-rank{rank}",
                            where(str(it["endpoint"]), rank) + ("?" + "&".join(query) if query else ""),
                            "kv-events", api, rank))
    return out


# ------------------------------------------------------------------------------ one engine
class FleetClient(EngineClient):
    """The dashboard's client, also naming every cached block by its content. It keeps a short
    history (the page draws the live state; Open attaches a client of its own) and pings often,
    so a stopped engine is dropped within PING_INTERVAL_S + PING_TIMEOUT_S even when idle."""
    PING_INTERVAL_S, PING_TIMEOUT_S = 5.0, 10.0

    def __init__(self, url: str, token: str | None = None, *, max_events: int = FLEET_EVENTS,
                 failed: Callable[[str], object] = lambda why: None):
        self.content: ContentTracker | None = None
        self.pending: dict[int, str] = {}  # submit command id -> request id, until the engine answers
        self.failed = failed               # a submit the engine refused, or left unanswered when its connection closed
        self.recent_steps: deque[tuple[float, int, float]] = deque(maxlen=4096)  # (arrival, tokens, duration_ms)
        self.preempted_at = 0.0  # wall time of the last preemption seen
        super().__init__(url, token, max_events=max_events)

    def submit(self, cmd: p.Submit) -> None:
        """Send `cmd`; its refusal, or the connection closing before an answer, goes to `failed`."""
        with self.lock:  # the answer is read under the lock too: never before the id is known
            self.pending[self.send(cmd)] = cmd.request_id or "request"

    def _on_reply(self, msg: p.Ack | p.Error) -> None:
        super()._on_reply(msg)
        rid = self.pending.pop(msg.id, None) if isinstance(msg.id, int) else None
        if rid is not None and isinstance(msg, p.Error):
            self.failed(f"{rid}: {msg.message}")

    def _on_disconnect(self, error: str) -> None:
        for rid in self.pending.values():
            self.failed(f"{rid}: no answer before the connection closed ({error})")
        self.pending.clear()

    def tokens_per_s(self, now: float) -> float:
        """Tokens per second of engine time over the steps that arrived in the last RATE_S: an idle
        engine (or one gone) reads 0 within RATE_S."""
        while self.recent_steps and self.recent_steps[0][0] < now - RATE_S:
            self.recent_steps.popleft()
        ms = sum(d for _, _, d in self.recent_steps)
        return 1000 * sum(n for _, n, _ in self.recent_steps) / ms if ms > 0 else 0.0

    def _new_history(self, snap: p.Snapshot) -> EventHistory:
        return EventHistory(snap, self.max_events, checkpoint_bytes=FLEET_CHECKPOINT_BYTES)

    def live(self) -> Mirror | None:
        """The live state (not a copy: read it under `lock`), or None before the first snapshot."""
        return self.history.live if self.history else None

    def _on_snapshot(self, snap: p.Snapshot) -> None:
        before = self.history.live.tally.preemptions if self.history else None
        super()._on_snapshot(snap)
        h = self.history
        if before is not None and h is not None and h.live.tally.preemptions > before:
            self.preempted_at = time.time()  # among the events the snapshot skipped, by its counters
        if h is not None:  # a snapshot that does not continue the stream: tokens before it are unknown
            old = self.content
            self.content = ContentTracker.from_state(h.live.state)
            if old is not None:  # what it already followed stays known: sequences' tokens, blocks' contents
                self.content.keep(old)

    def _on_event(self, ev: p.AnyEvent) -> None:
        h = self.history
        before = h.last_event if h else None
        super()._on_event(ev)
        h = self.history
        if h is None or h.last_event != ev.seq or before == ev.seq:
            return  # not applied
        if self.content is not None:
            self.content.apply(ev, h.live.state, self.received_at)
        if isinstance(ev, p.StepDone):
            self.recent_steps.append((self.received_at, *h.live.tally.steps[-1]))
        elif isinstance(ev, p.Preempt):
            self.preempted_at = self.received_at


@dataclass
class EngineRow:
    """One engine's numbers, as the fleet page lists them."""
    name: str
    kind: str
    url: str
    state: str            # live, connecting, stalled, down, silent, closed
    error: str = ""
    model: str = ""
    api: str = ""         # its OpenAI server, where its prompts go
    blocks: int = 0
    used: int = 0
    cached: int = 0
    free: int = 0
    block_size: int = 0
    bytes_per_block: int = 0
    hit_rate: float | None = None   # prefix-cache hit tokens over tokens looked up (None: the stream cannot say)
    first_hit_rate: float | None = None  # the same over first admissions only: vLLM's prefix_cache_hits / _queries
    preemptions: int | None = None
    preempting: bool = False        # it preempted in the last PREEMPTING_S
    running: int | None = None
    waiting: int | None = None
    tokens_per_s: float | None = None
    last_event_age_s: float | None = None
    seen_s_ago: float | None = None  # down: since when its numbers are the last seen (they are left out of live totals)
    gaps: int = 0                   # resyncs after missing event numbers, or batches missed (KV events)
    skipped: int = 0                # the events those resyncs skipped
    unknown_content: int = 0        # cached blocks named by server hash only

    @property
    def out_of_free(self) -> bool:
        return self.state == "live" and self.blocks > 0 and self.free == 0 and self.cached == 0

    @property
    def alarm(self) -> str:
        """Why this engine stands out, or ""."""
        if self.state in ("down", "silent", "stalled"):
            return self.state
        if self.out_of_free:
            return "no free blocks"
        if self.preempting:
            return "preempting"
        return ""


def stalled(row: EngineRow, loop: p.LoopState) -> bool:
    """A live engine that should be stepping (requests running, not paused) but has sent no
    event for STALL_S beyond its step delay. An idle engine sends nothing and is not stalled;
    if its process stops, the keepalive drops it instead."""
    return (row.state == "live" and bool(row.running) and not loop.paused and row.last_event_age_s is not None
            and row.last_event_age_s > STALL_S + loop.step_delay_ms / 1000)


class FleetEngine:
    """One endpoint and its client thread."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint.check()
        self.client: FleetClient | None = None
        self.subscriber = None
        self.load_errors: deque[str] = deque(maxlen=20)  # the load generator's failed sends, newest last
        self.load_failed = 0                             # and how many in all
        self._clear: int | threading.Thread | None = None  # the last clear asked: its command id, or its HTTP thread
        self._picture: tuple = (None, None)  # ((epoch, last event, drawer), the picture drawn then)
        if endpoint.kind == "kv-events":
            from integrations.kv_events.subscriber import KVEventsSubscriber  # pyzmq only when asked for
            self.subscriber = KVEventsSubscriber(endpoint.address)
        else:
            self.client = FleetClient(endpoint.address, endpoint.token or None, failed=self._load_failed)

    @property
    def name(self) -> str:
        return self.endpoint.name

    def _load_failed(self, why: str) -> None:
        self.load_failed += 1
        self.load_errors.append(why)

    def takes_prompts(self) -> bool:
        """Whether the load generator can send to it now: a live WebSocket engine that carries out
        `submit`, or a KV-event stream whose endpoint names its server's OpenAI API."""
        if self.client is not None:
            return self.client.status.state == "connected" and self.client.supports("submit")
        return bool(self.endpoint.api)

    def submit(self, cmd: p.Submit) -> None:
        """Send a request: over the engine's WebSocket, or to the OpenAI server of a KV-event stream
        (on a thread: its failures come back in `load_errors`)."""
        if self.client is not None:
            self.client.submit(cmd)
        elif self.endpoint.api:
            fleet_load.post_in_background(self.endpoint.api, cmd, self._load_failed)
        else:
            raise ValueError(f"{self.name} takes no prompts: a KV-event stream needs `api`, its server's OpenAI URL")

    def lookups(self) -> tuple[int, int] | None:
        """(prefix-hit tokens, tokens looked up) since this dashboard attached; None for a KV-event
        stream (it says what is cached, not what requests found)."""
        if self.client is None:
            return None
        with self.client.lock:
            view = self.client.view()
            return (view.mirror.tally.hit_tokens, view.mirror.tally.looked_up_tokens) if view else None

    def clear_prefix_cache(self) -> bool:
        """Ask the engine to empty its prefix cache (a vLLM only with VLLM_SERVER_DEV_MODE=1: its
        `/reset_prefix_cache`); False where it cannot be asked. `cleared()` says what came of it."""
        gate.check()
        self._clear = None
        if self.client is not None:
            if not self.client.supports("clear_prefix_cache"):
                return False
            self._clear = self.client.send(p.ClearPrefixCache())
            return True
        if not self.endpoint.api:
            return False
        self._clear = fleet_load.post_in_background(self.endpoint.api, None, self._load_failed,
                                                    path="/reset_prefix_cache")
        return True

    def cleared(self) -> str:
        """What the last `clear_prefix_cache` came to, in words: "emptied", "asking", or why not."""
        asked = self._clear
        if asked is None:
            return "cannot be asked" if self.client is None or not self.client.supports("clear_prefix_cache") \
                else "not asked"
        if isinstance(asked, threading.Thread):  # over HTTP: its failure, if any, is in load_errors
            return "asking" if asked.is_alive() else "asked its server (a KV-event stream shows it after its next step)"
        reply = self.client.reply(asked)
        return "asking" if reply is None else "emptied" if isinstance(reply, p.Ack) else f"refused: {reply.message}"

    def row(self, now: float | None = None) -> EngineRow:
        now = time.time() if now is None else now
        e = self.endpoint
        row = EngineRow(e.name, e.kind, e.address, "connecting", api=e.api)
        if self.subscriber is not None:
            return self._kv_events_row(row, now)
        c = self.client
        with c.lock:  # the live state itself, read under the client's lock: no copy of the pool per redraw
            status, m, content = c.status, c.live(), c.content
            row.state = {"connected": "live", "reconnecting": "down", "failed": "down"}.get(status.state, status.state)
            if row.state == "down" and c.hello is None and status.state == "reconnecting":
                row.state = "connecting"  # never reached yet: coming up (a vLLM loading its model refuses meanwhile)
            if row.state == "connecting":
                row.error = (f"not answering yet ({status.attempts} attempts, {now - status.since:.0f} s)"
                             if status.attempts else "")
            elif row.state != "live":  # why it went down, then what the retries meet
                row.error = " · retrying: ".join(dict.fromkeys(x for x in (status.cause, status.last_error) if x))
                row.seen_s_ago = now - status.since
            row.gaps, row.skipped = status.resyncs, status.skipped
            if c.hello:
                row.model = c.hello.engine.model
                row.api = row.api or c.hello.api_url or ""
            if m is None:
                return row
            counts = m.state.counts()
            cfg = m.config
            tl = m.tally
            row.blocks, row.free, row.cached, row.used = cfg.num_device_blocks, counts.free, counts.cached, counts.used
            row.block_size, row.bytes_per_block = cfg.block_size, cfg.bytes_per_block
            row.hit_rate = tl.hit_rate if tl.looked_up_tokens else None
            row.first_hit_rate = tl.first_hit_rate if tl.first_looked_up_tokens else None
            row.preemptions = tl.preemptions
            row.preempting = row.state == "live" and now - c.preempted_at < PREEMPTING_S
            step = tl.last_step
            row.running = step.num_running if step else sum(s.status == "running" for s in m.state.seqs.values())
            row.waiting = step.num_waiting if step else sum(s.status == "waiting" for s in m.state.seqs.values())
            row.tokens_per_s = c.tokens_per_s(now)
            row.last_event_age_s = now - c.received_at if c.received_at else None
            if stalled(row, c.loop):
                row.state = "stalled"
                row.error = (f"no event for {row.last_event_age_s:.0f} s while {row.running} requests run "
                             "(a stopped process, or an engine stuck in a step)")
            row.unknown_content = content.unknown if content else 0
        return row

    def _kv_events_row(self, row: EngineRow, now: float) -> EngineRow:
        s = self.subscriber
        with s.lock:
            stream = s.state
            row.cached = stream.num_cached()
            row.gaps = stream.missed
            row.last_event_age_s = now - s.received_at if s.received_at else None
            quiet = now - (s.received_at or s.connected_at)
            row.state = "live" if stream.batches and quiet < SILENT_S else "silent" if stream.batches else "connecting"
            row.error = stream.errors[-1] if stream.errors else ""
            sizes = (n.tokens and len(n.tokens) for groups in stream.caches.values() for f in groups.values()
                     for n in f.nodes.values())
            row.block_size = next(sizes, 0) or 0
            row.unknown_content = sum(1 for c in self._kv_contents() if c.cid.startswith(HASH_PREFIX))
        return row

    # ------------------------------------------------------------------ what it caches
    def contents(self) -> list[Content]:
        """Every cached block (one entry per physical copy) with its content id."""
        if self.subscriber is not None:
            with self.subscriber.lock:
                return self._kv_contents()
        c = self.client
        with c.lock:
            return list(c.content.contents()) if c.content else []

    def _kv_contents(self) -> list[Content]:
        """The stream's cached blocks on the GPU, named by content: each node's tokens under its
        parent's content id; a chain whose head this subscriber never saw (or without token ids)
        is named by its hashes. One entry per physical copy, in the KV-cache group that stored it."""
        out: list[Content] = []
        for g, forest in self.subscriber.state.caches.get(MEDIUM_GPU, {}).items():
            ids: dict[str, str] = {}
            for root in forest.roots():  # parents before children
                stack = [(root, ROOT if root.parent is None else None)]
                while stack:
                    node, parent = stack.pop()
                    known = parent is not None and not parent.startswith(HASH_PREFIX) and len(node.tokens)
                    cid = ids[node.key] = content_id(parent, node.tokens) if known else HASH_PREFIX + node.key
                    out.extend(Content(cid, parent, tuple(node.tokens), node.key, g) for _ in range(node.copies))
                    stack.extend((kid, cid) for kid in forest.kids(node))
        return out

    def evicted(self) -> dict[str, float]:
        """The contents it evicted (their last block in its cache went), by content id, and when
        (wall time): a KVScope engine's `evict` events, a stream's removals of its GPU blocks."""
        if self.subscriber is None:
            c = self.client
            with c.lock:
                return dict(c.content.evicted) if c.content else {}
        with self.subscriber.lock:
            known = {c.server_hash: c.cid for c in self._kv_contents()}
            gone = dict(self.subscriber.state.evicted)
        out = {}
        for h, (_, _, ts) in gone.items():
            if (cid := _content_of(h, known, gone)) is not None:
                out[cid] = ts
        return out

    def windows(self) -> dict[int, int | None]:
        """Its KV-cache groups' sliding windows (None: full attention), as its hello or its
        stream's store events name them; empty when it names none (one full-attention group)."""
        if self.subscriber is not None:
            with self.subscriber.lock:
                specs = self.subscriber.state.specs
                return {g: s.sliding_window if s.kind == "sliding_window" else None for g, s in specs.items()}
        hello = self.client.hello
        groups = hello.config.kv_groups if hello else []
        return {g: k.window for g, k in enumerate(groups)}

    def block_states(self) -> np.ndarray | None:
        """FREE/CACHED/USED/SHARED/RESERVED per device block, for the overview (None: no pool)."""
        if self.client is None:
            return None
        with self.client.lock:
            m = self.client.live()
            return m.state.block_states() if m else None

    def picture(self, draw: Callable[[np.ndarray], str]) -> str | None:
        """`draw(block_states())`, drawn again only when the pool has changed since (an engine
        steps every few redraws at most; a fleet of 64 need not redraw 64 pictures each time)."""
        if self.client is None:
            return None
        with self.client.lock:  # the state and its event number read together
            h = self.client.history
            if h is None:
                return None
            key = (self.client.epoch, h.last_event, draw)
            if self._picture[0] != key:
                states = h.live.state.block_states()
                self._picture = (key, draw(states) if len(states) else None)
            return self._picture[1]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.subscriber is not None:
            self.subscriber.close()


# ------------------------------------------------------------------------------ the fleet
@dataclass
class Fleet:
    engines: dict[str, FleetEngine] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, endpoints: list[Endpoint]) -> Fleet:
        f = cls()
        for e in endpoints:
            f.add(e)
        return f

    def add(self, endpoint: Endpoint) -> FleetEngine:
        with self._lock:
            if endpoint.name in self.engines:
                raise ValueError(f"there is already an engine named {endpoint.name!r}")
            eng = self.engines[endpoint.name] = FleetEngine(endpoint)
            return eng

    def remove(self, name: str) -> None:
        with self._lock:
            eng = self.engines.pop(name, None)
        if eng is not None:
            threading.Thread(target=eng.close, daemon=True).start()  # never wait on a stuck endpoint here

    def members(self) -> list[FleetEngine]:
        with self._lock:
            return list(self.engines.values())

    def rows(self) -> list[EngineRow]:
        now = time.time()
        return [e.row(now) for e in self.members()]

    def index(self, rows: list[EngineRow] | None = None) -> FleetIndex:
        """The prefix cache across the fleet's engines that are up, now (`rows`: this moment's rows,
        if read already); a down engine's cache is only its last seen, so it is left out."""
        by_name = {r.name: r for r in rows or self.rows()}
        return FleetIndex.build([EngineCache(e.name, row.block_size, row.bytes_per_block, e.contents(), e.windows(),
                                             e.evicted())
                                 for e in self.members() if (row := by_name.get(e.name)) and row.state in COUNTED])

    def close(self) -> None:
        for e in self.members():
            e.close()


def _content_of(h: str, known: dict[str, str], gone: dict) -> str | None:
    """The content id of removed block `h`: its tokens under its parent's content id, the parent
    found among the blocks still cached (`known`, hash -> id) or those removed (`gone`, hash ->
    (parent, tokens, time)); None when a block of the chain is unknown. Memoised in `known`."""
    chain = []
    while h not in known:
        if h is None:
            break
        rec = gone.get(h)
        if rec is None or not rec[1]:
            return None
        chain.append(h)
        h = rec[0]
    cid = ROOT if h is None else known[h]
    if cid.startswith(HASH_PREFIX):
        return None
    for x in reversed(chain):
        cid = known[x] = content_id(cid, gone[x][1])
    return cid


# ------------------------------------------------------------------------------ tokens
def tokenize(engine: FleetEngine, text: str = "", timeout: float = 5.0, *,
             messages: list[p.ChatMessage] | None = None) -> list[int] | None:
    """`text` as `engine` tokenizes a plain prompt, or `messages` as it runs a chat (its chat
    template, with the assistant's turn opened, as the load generator's chats run): its OpenAI
    server's `/tokenize` (vLLM) when the endpoint gives `api`, a KVScope engine's own `GET
    /tokenize` (on its WebSocket port); None when neither answers."""
    e = engine.endpoint
    chat = [{"role": m.role, "content": m.content} for m in messages] if messages else None
    if e.api:
        body = {"messages": chat, "add_generation_prompt": True} if chat else {"prompt": text}
        req = urllib.request.Request(e.api.rstrip("/") + "/tokenize", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    elif e.kind == "kvscope":
        parts = urlsplit(e.address)
        query = {"messages": json.dumps(chat)} if chat else {"prompt": text}
        req = urllib.request.Request(urlunsplit(parts._replace(scheme="https" if parts.scheme == "wss" else "http",
                                                               path="/tokenize", query=urlencode(query))),
                                     headers={"Authorization": f"Bearer {e.token}"} if e.token else {})
    else:
        return None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return list(json.loads(r.read())["tokens"])
    except (OSError, ValueError, KeyError):
        return None
