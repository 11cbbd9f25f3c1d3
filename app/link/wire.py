"""Reading a KVScope server's WebSocket (the engine, a replay, the vLLM plugin), one way for
every reader: `open_ws` connects as each client does (any message size, no compression, the
optional features asked for in the URL, a bearer token), and `WireClient` reads one connection
synchronously: each server message decoded, the pool mirrored as the dashboard mirrors it
(app/history/mirror.py), the events counted by kind, commands encoded by the protocol.

The dashboard's EngineClient (client.py) opens its connection here and follows it on a thread
of its own, reconnecting; the tests' client (tests/protocol_client.py), the demo recorder and
the benches read through WireClient.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from kvscope_contract import protocol as p
from kvscope_contract.kinds import kind_of
from kvscope_contract.state import PoolState
from app.history.mirror import Mirror


def with_features(url: str, features: Sequence[str]) -> str:
    """`url` asking the server for optional protocol features (`?features=a,b`)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "features"] + [("features", ",".join(features))]
    return urlunsplit(parts._replace(query=urlencode(query, safe=",")))


def open_ws(url: str, features: Sequence[str] = (), token: str | None = None, **options) -> ClientConnection:
    """A connection to the server at `url` (features, if any, asked for in its query); `options`
    go to websockets' connect (open_timeout, max_queue, ping_interval, ...)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    options = {"max_size": None, "compression": None, "additional_headers": headers, **options}
    return connect(with_features(url, features) if features else url, legacy=True, **options)


class WireClient:
    """One connection, read synchronously. `mirror=False` skips the mirror (a reader that only
    counts or stamps what arrives, beside an engine being measured)."""

    def __init__(self, url: str, *, features: Sequence[str] = (), token: str | None = None, mirror: bool = True,
                 open_timeout: float = 10, **options):
        self.ws = open_ws(url, features, token, open_timeout=open_timeout, **options)
        self.mirrors = mirror
        self.mirror: Mirror | None = None
        self.kinds: Counter[str] = Counter()
        self.frame: str | bytes = ""  # the last frame as it came, for checks of the wire format itself
        self._ids = itertools.count(1)
        hello = self.read(timeout=30)
        if not isinstance(hello, p.Hello):
            raise ConnectionError(f"{url}: the server's first message is a {type(hello).__name__}, not a hello")
        self.hello: p.Hello = hello

    @property
    def state(self) -> PoolState | None:
        return self.mirror.state if self.mirror else None

    def read(self, timeout: float | None = None) -> p.ServerMessage:
        """The next message, applied to the mirror; TimeoutError when none comes in `timeout` s."""
        self.frame = self.ws.recv(timeout=timeout)
        msg = p.decode_server_message(self.frame)
        if isinstance(msg, p.Snapshot) and self.mirrors:
            self.mirror = Mirror.from_snapshot(msg)
        elif isinstance(msg, p.Events):
            for ev in msg.events:
                self.kinds[kind_of(ev)] += 1
                if self.mirror is not None:
                    self.mirror.apply(ev)
        return msg

    def read_until(self, until: Callable[[p.ServerMessage], object], timeout: float = 60) -> p.ServerMessage:
        """Read until `until(message)` holds; that message (TimeoutError after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.read(timeout=max(0.01, deadline - time.monotonic()))
            if until(msg):
                return msg

    def __iter__(self) -> Iterator[p.ServerMessage]:
        """Every message until the server closes the connection."""
        try:
            while True:
                yield self.read()
        except ConnectionClosed:
            return

    def send(self, cmd: p.Command) -> None:
        self.ws.send(p.encode(cmd).decode())

    def request(self, cmd: p.Command, timeout: float = 60) -> p.Ack | p.Error:
        """Send `cmd` under a fresh id and read (applying what comes meanwhile) until its answer."""
        cmd.id = f"w{next(self._ids)}"
        self.send(cmd)
        return self.read_until(lambda m: isinstance(m, (p.Ack, p.Error)) and m.id == cmd.id, timeout)

    def close(self) -> None:
        self.ws.close()
