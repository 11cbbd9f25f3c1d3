"""How the dashboard is started: `streamlit run app/main.py` headless, without usage stats.
`kvscope` (app/__main__.py) and the headless tools and tests (tools/launch.py) build their
command here; the Makefile's `make run` says the same in make's words (STREAMLIT_FLAGS)."""
from __future__ import annotations

from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"
HEADLESS = ("--server.headless", "true", "--browser.gatherUsageStats", "false")


def streamlit_argv(python: str, app_args: list[str], *options: str, main: str | Path = MAIN) -> list[str]:
    """`python -m streamlit run MAIN --server.headless true ... OPTIONS -- APP_ARGS`."""
    return [python, "-m", "streamlit", "run", str(main), *HEADLESS, *options, "--", *app_args]
