"""Icons in the HTML the live views draw: Streamlit's own Material Symbols, whose font comes with
the page (nothing is asked of another machine)."""
from __future__ import annotations

# the symbols' style, for HTML drawn where the live views' stylesheet (assets/live.css) is not
CSS = ('<style>.ms { font-family: "Material Symbols Rounded"; font-size: 1.15em; line-height: 1; '
       'vertical-align: -0.2em; margin: 0 0.2em; }</style>')


def icon(name: str) -> str:
    """The symbol `name` (e.g. "history"), hidden from screen readers: the words beside it say it."""
    return f'<span class="ms" aria-hidden="true">{name}</span>'
