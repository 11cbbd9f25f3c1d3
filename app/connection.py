"""The process-wide resources behind a Source: the child server (embedded engine or replay)
and the client connected to it, kept across reruns and shared by every browser session."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import streamlit as st

from app.client import EngineClient
from app.launcher import ServerProcess
from app.source import Source


@dataclass(eq=False)
class Hosted:
    """A child server and, once it listens, the client attached to it."""
    process: ServerProcess
    client: EngineClient | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ready_client(self) -> EngineClient | None:
        with self._lock:  # sessions race here when the server comes up
            if self.client is None and self.process.url:
                self.client = EngineClient(self.process.url)
            return self.client

    def close(self) -> None:
        if self.client:
            self.client.close()
        self.process.stop()


def _usable(h: Hosted) -> bool:
    """A server that crashed after it was ready is started again (validate=False drops the
    entry without on_release, so release it here); one that never came up stays, to show why."""
    if h.process.state == "exited" and h.process.ready_after is not None:
        h.close()
        return False
    return True


@st.cache_resource(show_spinner=False, max_entries=3, validate=_usable, on_release=Hosted.close)
def hosted(module: str, args: tuple[str, ...]) -> Hosted:
    return Hosted(ServerProcess(module, list(args)).start())


@st.cache_resource(show_spinner=False, max_entries=8, on_release=EngineClient.close)
def attached(url: str, token: str) -> EngineClient:
    return EngineClient(url, token or None)


def resolve(source: Source) -> tuple[EngineClient | None, Hosted | None]:
    """The client for `source` (None while its server is still starting) and its child server."""
    if source.kind == "attach":
        return attached(source.url, source.token), None
    h = hosted(*source.server_args())
    return h.ready_client(), h


def restart(source: Source) -> None:
    """Stop the child server of `source` (if any) so the next `resolve` starts a fresh one."""
    if source.kind == "attach":
        attached.clear(source.url, source.token)
        return
    hosted(*source.server_args()).close()
    hosted.clear(*source.server_args())
