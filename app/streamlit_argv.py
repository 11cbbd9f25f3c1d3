"""How the dashboard is started: `streamlit run app/main.py` headless, without usage stats, and
without watching its files (a dashboard, not a script being edited). Every way of starting it
builds its command here: `kvscope` and `make run` (app/__main__.py), `make run-fleet`
(tools/fleet_demo.py), the headless tools and tests (tools/launch.py)."""
from __future__ import annotations

from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"
# "1" in the app's environment: the grid's script publishes what it drew (window.__kvscope_grid, ...)
# for a browser driven by tests, the screenshots and the benches (tools/launch.py turns it on)
TEST_HOOKS = "KVSCOPE_TEST_HOOKS"
HEADLESS = ("--server.headless", "true", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false")


def streamlit_argv(python: str, app_args: list[str], *options: str, main: str | Path = MAIN) -> list[str]:
    """`python -m streamlit run MAIN --server.headless true ... OPTIONS -- APP_ARGS`."""
    return [python, "-m", "streamlit", "run", str(main), *HEADLESS, *options, "--", *app_args]
