"""The live views' lane: a WebSocket of the dashboard's process, beside Streamlit's, that answers
an element's ask for its next frame without a rerun.

Through Streamlit a redraw pays for a rerun: the ask's round trip to the script thread, the
rerun's messages and the page's React work for them, about 100 ms at a million blocks. The
lane carries only the frame, composed by the code a rerun runs (app/panels/grid.Element), so
every live view of it still comes from one redraw. A rerun opens the lane with what to redraw
(the session's search, pin, tallies are the rerun's), or closes it when a redraw needs the
session (a lesson, time travel, a paused engine, a command's answer: one rule,
`Redraw.lane_may_draw`, that the rerun and each of the lane's frames follow): the browser then
asks through Streamlit again. A browser that cannot reach the lane's port (a proxy that forwards
only Streamlit's) asks through Streamlit, as before, and sees the same views, less often.

Elements are registered weakly, by an unguessable token: a session that ends takes its lane
with it, and a page sees only its own session's frames. Only the dashboard's own page may connect
(its Origin names the host it reached the lane by; kvscope_contract/access.py), it must name its
element within TOKEN_WAIT_S, and at most MAX_CONNECTIONS are open at once.
"""
from __future__ import annotations

import asyncio
import http
import json
import logging
import secrets
import socket
import threading
import weakref
from typing import Protocol

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from kvscope_contract.access import is_loopback, lane_refusal

log = logging.getLogger(__name__)
MAX_ASK = 4096  # bytes: an ask is a small JSON object; anything larger is not one
TOKEN_WAIT_S = 5.0  # a connection that names no element by then is closed
MAX_CONNECTIONS = 256  # a tab holds one; far more is not a room of viewers


class Served(Protocol):
    @property
    def lane_open(self) -> bool: ...

    def serve(self, sync: dict) -> bytes | None: ...


class LaneServer:
    """One per process: a WebSocket server on its own thread and port."""

    def __init__(self, host: str | None):
        self.elements: weakref.WeakValueDictionary[str, Served] = weakref.WeakValueDictionary()
        self.tokens: weakref.WeakKeyDictionary[Served, str] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.port: int | None = None
        self.loopback_only = bool(host) and is_loopback(host)
        self.connections = 0
        ready = threading.Event()
        threading.Thread(target=lambda: asyncio.run(self._run(host, ready)), name="kvscope-lane", daemon=True).start()
        ready.wait(10)

    async def _run(self, host: str | None, ready: threading.Event) -> None:
        try:
            with listening(host) as sock:
                async with serve(self._answer, sock=sock, max_size=MAX_ASK, compression=None, logger=log,
                                 process_request=self._admit) as server:
                    self.port = sock.getsockname()[1]
                    ready.set()
                    await server.serve_forever()
        except OSError as e:  # no port to be had: every ask goes through Streamlit
            log.warning("the live views' lane did not open (%s): redraws go through Streamlit", e)
            ready.set()

    def token(self, element: Served) -> str:
        """The element's token (the same for its life)."""
        with self.lock:
            if (t := self.tokens.get(element)) is None:
                t = self.tokens[element] = secrets.token_urlsafe(18)
                self.elements[t] = element
            return t

    def _admit(self, conn: ServerConnection, request: Request) -> Response | None:
        """Before the handshake: only the dashboard's page, and not too many."""
        if why := lane_refusal(request.headers.get("Origin"), request.headers.get("Host"), self.loopback_only):
            return conn.respond(http.HTTPStatus.FORBIDDEN, why + "\n")
        if self.connections >= MAX_CONNECTIONS:
            return conn.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n")
        return None

    async def _answer(self, ws: ServerConnection) -> None:
        """First the element's token, then per ask (its `sync`) the next frame, or "streamlit"
        when the element's redraw needs a rerun."""
        self.connections += 1  # on the lane's one event loop: no lock needed
        try:
            try:
                named = await asyncio.wait_for(ws.recv(), TOKEN_WAIT_S)
            except TimeoutError:
                await ws.close(4408, "no element named in time")
                return
            element = self.elements.get(named) if isinstance(named, str) else None
            if element is None:
                await ws.close(4404, "no such element (the session ended)")
                return
            async for ask in ws:
                sync = json.loads(ask)
                # on this thread: a frame's work holds the GIL all along, and a hand-off to another
                # thread only waits for it longer, behind the engine's client
                out = element.serve(sync) if isinstance(sync, dict) else None
                await ws.send(out if out is not None else "streamlit")
        except (ConnectionClosed, ValueError):
            pass  # a tab closed, or an ask that is not one: the browser asks through Streamlit
        finally:
            self.connections -= 1


def listening(host: str | None) -> socket.socket:
    """A socket on a free port of `host`; no host: every address, IPv4 and IPv6 on one port
    (the browser reaches it by the page's host name, whichever family that resolves to)."""
    if host:
        return socket.create_server((host, 0))
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


_server: LaneServer | None = None
_started = threading.Lock()


def server() -> LaneServer:
    """The process's lane, opened on first use, on the address Streamlit listens on."""
    global _server
    with _started:
        if _server is None:
            import streamlit as st
            _server = LaneServer(st.get_option("server.address"))
        return _server


def address(element: Served) -> dict | None:
    """What the browser needs to reach the element's lane (None: there is none), and whether the
    lane redraws now (`open`: the element's own answer, the one its `serve` gives), or the browser
    asks through Streamlit."""
    s = server()
    return None if s.port is None else {"port": s.port, "token": s.token(element), "open": element.lane_open}
