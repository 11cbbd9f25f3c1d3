"""The one check every command that changes an engine passes (EngineClient.send, the fleet's cache
clearing, a new source, a restart): the dashboard's roles (app/ui/roles.py) install who may pass.
It lives here, below the clients, so that no path to an engine goes around it."""
from __future__ import annotations

from typing import Callable


class Refused(Exception):
    """A command from a session that may not change an engine (a viewer of a shared dashboard)."""


_why_not: Callable[[], str | None] = lambda: None  # None: allowed; otherwise why not


def install(why_not: Callable[[], str | None]) -> None:
    global _why_not
    _why_not = why_not


def check() -> None:
    """Raise Refused when the caller may not change an engine."""
    if (why := _why_not()) is not None:
        raise Refused(why)
