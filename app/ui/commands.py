"""Sending commands from a session, and telling the user how each one ended (a toast per
answer: the engine's `ack` or its `error` message, never silence)."""
from __future__ import annotations

import time

import streamlit as st

from kvscope_contract import protocol as p
from app.link.client import EngineClient, NotConnected
from app.link.gate import Refused

REPLY_TIMEOUT_S = 15.0
ERROR_SHOWN_S = 60.0  # the sidebar's "last error" line fades after this long (or the next success)


def send(client: EngineClient, cmd: p.Command, action: str, quiet: bool = False) -> bool:
    """Send `cmd`; its answer is shown later by `show_replies`. `action` names what the user
    did ("Submit", "Reset to 12 × 16"); `quiet`: toast errors only."""
    try:
        cid = client.send(cmd)
    except (NotConnected, Refused) as e:
        _failed(action, str(e))
        return False
    st.session_state.setdefault("pending", {})[cid] = (action, quiet, time.time())
    return True


def _failed(action: str, why: str) -> None:
    st.toast(f"**{action}** failed: {why}", icon=":material/error:")
    st.session_state["last_error"] = (time.time(), f"{action} failed: {why}")


def show_replies(client: EngineClient) -> None:
    pending: dict = st.session_state.setdefault("pending", {})
    for cid, (action, quiet, sent) in list(pending.items()):
        r = client.reply(cid)
        if isinstance(r, p.Error):
            _failed(action, f"{r.message} ({r.code})")
        elif isinstance(r, p.Ack):
            st.session_state.pop("last_error", None)  # it worked now: the old error no longer applies
            if not quiet:
                st.toast(action + (f": {', '.join(r.seq_ids)}" if r.seq_ids else ""), icon=":material/check_circle:")
        elif time.time() - sent < REPLY_TIMEOUT_S:
            continue
        else:
            _failed(action, f"no answer from the engine after {REPLY_TIMEOUT_S:g} s")
        del pending[cid]


def last_error() -> str | None:
    """The session's last failed command, while it is recent."""
    if (err := st.session_state.get("last_error")) and time.time() - err[0] < ERROR_SHOWN_S:
        return f"{err[1]} ({time.time() - err[0]:.0f} s ago)"
    return None
