"""The process-wide resources behind a Source: the child server (embedded engine or replay)
and the client connected to it, kept across reruns and shared by every browser session.

A child that dies is never started again behind the user's back: its exit and last lines are
shown, its history stays browsable, and "Restart" (or the auto-restart setting) starts it
again with the pool config and pace it last had.
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

import streamlit as st

from kvscope_contract import protocol as p
from app.link import gate
from app.link.client import EngineClient
from app.link.launcher import ServerProcess
from app.link.source import Source, python_for


@dataclass(eq=False)
class Hosted:
    """A child server and, once it listens, the client attached to it."""
    module: str
    args: tuple[str, ...]
    process: ServerProcess = field(init=False)
    client: EngineClient | None = None
    previous: EngineClient | None = None  # the client of the process before the last restart: its history, browsable
    auto_restart: bool = False
    restarts: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.process = self._spawn(self.args)

    def _spawn(self, args: tuple[str, ...]) -> ServerProcess:
        # a fresh random token each start: no other process on this machine can drive it
        return ServerProcess(self.module, list(args), python_for(self.module), on_exit=self._exited,
                             token=secrets.token_urlsafe(24)).start()

    def ready_client(self) -> EngineClient | None:
        with self._lock:  # sessions race here when the server comes up
            if self.client is None and self.process.url:
                self.client = EngineClient(self.process.url, self.process.token)
            return self.client

    def _exited(self, proc: ServerProcess) -> None:
        """On the dead child's log thread: stop reconnecting to a port nobody listens on."""
        if proc is not self.process or not proc.died:
            return
        if self.client:
            self.client.close(f"the {self.module.removeprefix('engine.')} process died ({proc.exit_reason()})")
        if self.auto_restart:
            self.restart(proc)

    def last_config(self) -> tuple[p.PoolConfig | None, float]:
        """The pool config and pace the child last reported (None before its first snapshot)."""
        view = self.client.view() if self.client else None
        return (view.mirror.config if view else None), (self.client.loop.step_delay_ms if self.client else 0.0)

    def restart(self, dead: ServerProcess | None = None) -> None:
        """Start the child again; an engine keeps its last pool config and pace. `dead`: restart
        only if that process is still the current one (a click that arrives twice, or from two
        tabs, restarts once: a second restart would start before any config is known)."""
        with self._lock:
            if dead is not None and dead is not self.process:
                return
            config, pace = self.last_config()
            args = tuple(self.process.args)  # before a snapshot: what the current child was given
            if self.module == "engine.serve.server" and config is not None:
                args = self.args + ("--pool", p.encode(config).decode(), "--step-delay-ms", f"{pace:g}")
            self.close()
            if self.client is not None and self.client.view() is not None:
                self.previous = self.client  # closed, its history kept
            self.client, self.restarts = None, self.restarts + 1
            self.process = self._spawn(args)

    def close(self) -> None:
        if self.client:
            self.client.close()
        self.process.stop()


@st.cache_resource(show_spinner=False, max_entries=3, on_release=Hosted.close)
def hosted(module: str, args: tuple[str, ...]) -> Hosted:
    return Hosted(module, args)


@st.cache_resource(show_spinner=False, max_entries=8, on_release=EngineClient.close)
def attached(url: str, token: str) -> EngineClient:
    return EngineClient(url, token or None)


def resolve(source: Source) -> tuple[EngineClient | None, Hosted | None]:
    """The client for `source` (None while its server is still starting) and its child server."""
    if source.kind == "attach":
        return attached(source.url, source.token), None
    h = hosted(*source.server_args())
    return h.ready_client(), h


def restart(source: Source, dead: ServerProcess | None = None) -> None:
    """Start the child server of `source` again (attached engines: reconnect afresh); `dead`:
    only if that process is still its child."""
    gate.check()
    if source.kind == "attach":
        attached.clear(source.url, source.token)
    else:
        hosted(*source.server_args()).restart(dead)
