"""Where a server listens: a free port to start it on, the line an engine server
(engine.serve.server, engine.serve.replay, engine.synthetic, the vLLM plugin) prints once it
listens, and the one reader of its address: the dashboard's launcher, the tests and the benches
wait for it. The vLLM plugin prints a refused line instead when it cannot observe its vLLM."""
from __future__ import annotations

import re
import socket

_READY = re.compile(r"ready: (ws://\S+)")
_REFUSED = re.compile(r"not observing: (.+)")


def ready_line(url: str, what: str) -> str:
    """`ready: ws://host:port/ <what it serves>`."""
    return f"ready: {url} {what}"


def refused_line(why: str) -> str:
    """`not observing: <why>`: a plugin that cannot observe its engine, which serves on without it
    (the launcher shows why in the dashboard instead of waiting for a ready line)."""
    return f"not observing: {why}"


def refused_reason(line: str) -> str | None:
    """Why, in a refused line; None for any other line."""
    m = _REFUSED.search(line)
    return m.group(1).strip() if m else None


def ws_url(host: str, port: int) -> str:
    return f"ws://{host}:{port}/"


def ready_url(line: str) -> str | None:
    """The address in a ready line (the first, in a log of many lines), or None."""
    m = _READY.search(line)
    return m.group(1) if m else None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports nothing listens on now (the OS's picks), for servers started next; each is
    held until all are picked, so the OS cannot hand out one twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick), for a server started next."""
    return free_ports(1, host)[0]
