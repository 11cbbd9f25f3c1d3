"""Who drives a shared dashboard: viewers and the presenter.

On loopback (the default, app/.streamlit/config.toml) every session is the presenter's own. Once
Streamlit listens beyond loopback (`kvscope --share`, `--server.address 0.0.0.0`), a session is a
viewer (the live views, time travel of its own) unless it opened the presenter's link: a secret
printed on the console, which the session trades for a role held in its server-side state, and
removes from the address bar at once. It is never rendered into a widget or a page. The session
decides on the server: every command passes app/link/gate.py, which refuses a viewer's.
"""
from __future__ import annotations

import hmac
import os
import secrets
import sys

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from app.link import gate
from app.streamlit_argv import PRESENTER_KEY
from kvscope_contract.access import is_loopback

PARAM = "presenter"  # the link's query parameter
ROLE = "presenter"  # session state: True once this session showed the key
REFUSED = "only the presenter drives the engine of a shared dashboard"

# taken out of the environment at once: the engines this process starts never see it
_given = os.environ.pop(PRESENTER_KEY, "")
_KEY = _given or secrets.token_urlsafe(24)
_announced = bool(_given)


def shared() -> bool:
    """Whether Streamlit listens beyond loopback (unset: under AppTest, which listens nowhere)."""
    address = st.get_option("server.address")
    return bool(address) and not address.startswith("unix://") and not is_loopback(address)


def presenter_link(port: int | None = None) -> str:
    return f"http://localhost:{port or st.get_option('server.port')}/?{PARAM}={_KEY}"


def claim() -> None:
    """At the start of each run: a session that brings the key becomes the presenter's, and the
    key leaves its address bar (a projected browser shows no secret)."""
    global _announced
    if not shared():
        return
    if not _announced:  # `streamlit run` without our launcher: say the link once, on the console
        _announced = True
        print(f"KVScope is shared: viewers see it read-only. Presenter's link (keep it to yourself): "
              f"{presenter_link()}", file=sys.stderr, flush=True)
    given = st.query_params.get(PARAM)
    if given is not None:
        del st.query_params[PARAM]
        if hmac.compare_digest(given.encode(), _KEY.encode()):
            st.session_state[ROLE] = True


def may_drive() -> bool:
    """Whether this session may change an engine: every session on loopback, the presenter's when shared."""
    return not shared() or bool(st.session_state.get(ROLE))


def _why_not() -> str | None:
    if get_script_run_ctx(suppress_warning=True) is None:
        return None  # no session: the dashboard's own threads (a lesson's, a client's)
    return None if may_drive() else REFUSED


def viewer_note() -> None:
    st.caption(":material/visibility: You are viewing: the presenter drives the engine. "
               "Time travel and the views are yours.")


gate.install(_why_not)
