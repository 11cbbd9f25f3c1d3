"""Sending commands from a session, and telling the user how each one ended (a toast per
answer: the engine's `ack` or its `error` message, never silence)."""
from __future__ import annotations

import time

import streamlit as st

from engine.contract import protocol as p
from app.client import EngineClient, NotConnected

REPLY_TIMEOUT_S = 15.0


def send(client: EngineClient, cmd: p.Command, label: str, quiet: bool = False) -> bool:
    """Send `cmd`; its answer is shown later by `show_replies`. `quiet`: toast errors only."""
    try:
        cid = client.send(cmd)
    except NotConnected as e:
        st.toast(f"{label}: {e}", icon=":material/warning:")
        st.session_state["last_error"] = f"{label}: {e}"
        return False
    st.session_state.setdefault("pending", {})[cid] = (label, quiet, time.time())
    return True


def show_replies(client: EngineClient) -> None:
    pending: dict = st.session_state.setdefault("pending", {})
    for cid, (label, quiet, sent) in list(pending.items()):
        r = client.reply(cid)
        if isinstance(r, p.Error):
            st.toast(f"**{label}** failed: {r.message}", icon=":material/error:")
            st.session_state["last_error"] = f"{label}: {r.message} ({r.code})"
        elif isinstance(r, p.Ack):
            if not quiet:
                st.toast(f"{label}" + (f": {', '.join(r.seq_ids)}" if r.seq_ids else ""), icon=":material/check_circle:")
        elif time.time() - sent < REPLY_TIMEOUT_S:
            continue
        else:
            st.toast(f"**{label}**: no answer from the engine after {REPLY_TIMEOUT_S:g} s", icon=":material/warning:")
        del pending[cid]
