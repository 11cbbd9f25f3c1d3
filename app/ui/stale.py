"""The page after a widget outside every fragment changed in a fragment's run.

A click or a new value can reach Streamlit's server with a fragment's timed rerun: the widget's
callback then runs there, and only that fragment redraws, so the rest of the page (the sidebar's
mode, the Connection panel) would keep drawing the old choice. Such widgets mark the page stale
in their callback; a full run starts fresh, and a fragment that finds the page stale redraws it.
"""
from __future__ import annotations

import streamlit as st

STALE = "page_stale"  # session state: a widget outside the fragments changed since the last full run


def mark() -> None:
    """on_change / on_click of a widget outside every fragment."""
    st.session_state[STALE] = True


def full_run() -> None:
    """At the start of the main script: this run draws the whole page."""
    st.session_state.pop(STALE, None)


def redraw_if_stale() -> None:
    """In a fragment: the whole page, if a widget outside changed in this fragment's run."""
    if st.session_state.pop(STALE, False):
        st.rerun()
