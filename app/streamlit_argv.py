"""How the dashboard is started: `streamlit run app/main.py` headless, without usage stats, and
without watching its files (a dashboard, not a script being edited). Every way of starting it
builds its command here: `kvscope` and `make run` (app/__main__.py), `make run-fleet`
(tools/fleet_demo.py), the headless tools and tests (tools/launch.py)."""
from __future__ import annotations

import secrets
import socket
from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"
# "1" in the app's environment: the grid's script publishes what it drew (window.__kvscope_grid, ...)
# for a browser driven by tests, the screenshots and the benches (tools/launch.py turns it on)
TEST_HOOKS = "KVSCOPE_TEST_HOOKS"
PRESENTER_KEY = "KVSCOPE_PRESENTER_KEY"  # environment: the presenter's secret (app/ui/roles.py), never argv
SHARE = "--share"
HEADLESS = ("--server.headless", "true", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false")


def streamlit_argv(python: str, app_args: list[str], *options: str, main: str | Path = MAIN) -> list[str]:
    """`python -m streamlit run MAIN --server.headless true ... OPTIONS -- APP_ARGS`."""
    return [python, "-m", "streamlit", "run", str(main), *HEADLESS, *options, "--", *app_args]


def share(app_args: list[str], env: dict[str, str]) -> tuple[list[str], tuple[str, ...]]:
    """`--share` among APP_ARGS: Streamlit's options that listen on every interface, a presenter's
    key put into `env` for the app, and both links said on the console (app/ui/roles.py). Returns
    (APP_ARGS without it, options); without it, the app listens on loopback only
    (app/.streamlit/config.toml)."""
    if SHARE not in app_args:
        return app_args, ()
    key = env[PRESENTER_KEY] = secrets.token_urlsafe(24)
    port = env.get("STREAMLIT_SERVER_PORT", "8501")
    print(f"KVScope is shared on every interface: the room opens http://{socket.gethostname()}:{port} "
          f"(viewers: the live views, no controls).\nPresenter (every control; keep it to yourself): "
          f"http://localhost:{port}/?presenter={key}", flush=True)
    return [a for a in app_args if a != SHARE], ("--server.address", "0.0.0.0")
