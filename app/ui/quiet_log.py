"""Streamlit's log without its notes on a fragment rerun that arrives for a fragment no longer on
the page.

A fragment's timer in the browser outlives the fragment by a tick or two when the page is drawn
without it (an engine opened from the fleet page, whose four fragments redraw every 0.3 to 2 s, or
a click's full rerun that moves one), and a click can reach the server for a fragment just
redrawn away: Streamlit drops that rerun and says so (at INFO for a timer, WARNING for a click,
"mainly for debugging", its issue 9080), dozens of times an hour on the fleet page. Nothing is lost
(the rerun was for a fragment no longer shown), so the notes are only noise in `make run-fleet`'s
log.
"""
from __future__ import annotations

import logging

NOTES = {  # logger -> the start of its note
    "streamlit.runtime.app_session": "The fragment with id",
    "streamlit.runtime.scriptrunner.script_runner": "Couldn't find fragment with id",
}


class DropStaleFragmentNotes(logging.Filter):
    def __init__(self, note: str):
        super().__init__()
        self.note = note

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.note)


def install() -> None:
    """Once per process (the main script runs again at every rerun)."""
    for name, note in NOTES.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, DropStaleFragmentNotes) for f in log.filters):
            log.addFilter(DropStaleFragmentNotes(note))
