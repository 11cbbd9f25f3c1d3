"""What the engine server and the replay server share on the command line: where to listen,
the refusal to listen beyond loopback without a token, and serving until SIGINT or SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from engine.serve.hub import Hub
from kvscope_contract.access import TOKEN_ENV, VIEW_TOKEN_ENV, is_loopback

log = logging.getLogger("kvscope")
DEFAULT_PORT = 8765


def add_listen_args(ap: argparse.ArgumentParser, port: int = DEFAULT_PORT) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=port, help="0 picks a free port")
    ap.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                    help=f"required of clients; needed to bind beyond loopback "
                         f"(or ${TOKEN_ENV}: `ps` shows no environment)")
    ap.add_argument("--view-token", default=os.environ.get(VIEW_TOKEN_ENV) or None,
                    help=f"with a token: a second one that only views (events, /metrics), never commands "
                         f"(or ${VIEW_TOKEN_ENV})")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[kvscope] %(message)s", stream=sys.stderr)
    # websockets logs every connection, each /metrics scrape included: keep only its warnings
    logging.getLogger("websockets").setLevel(logging.WARNING)


def refuse_open_bind(host: str, token: str | None) -> bool:
    """True (and says why) when `host` is reachable from the network and no token guards it."""
    if is_loopback(host) or token:
        return False
    log.error("refusing to bind %s without --token: anyone on the network could drive the engine", host)
    return True


def serve_until_signal(hub: Hub, host: str, port: int, on_ready=None) -> None:
    """Serve `hub` in this thread until SIGINT or SIGTERM; `on_ready(port)` once listening."""
    serve_all_until_signal([(hub, port)], host, on_ready and (lambda _, bound: on_ready(bound)))


def serve_all_until_signal(hubs: list[tuple[Hub, int]], host: str, on_ready=None) -> None:
    """Serve each (hub, port) on one event loop in this thread until SIGINT or SIGTERM, each its
    own server; `on_ready(i, port)` once hub i listens."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        await asyncio.gather(*(hub.serve(host, port, on_ready and (lambda bound, i=i: on_ready(i, bound)), stop)
                               for i, (hub, port) in enumerate(hubs)))

    asyncio.run(main())
