"""`kvscope [ARGS]` (or `python -m app`): the dashboard, as `streamlit run app/main.py -- ARGS`.

ARGS are the dashboard's own (app/source.py): `--engine ws://...`, `--replay FILE`, or flags
for the embedded engine. Streamlit's options come from the environment (STREAMLIT_SERVER_PORT=...).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):  # say how to use it, start nothing
        from app.source import parser
        parser(prog="kvscope").print_help()
        return
    argv = [sys.executable, "-m", "streamlit", "run", str(MAIN), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--", *sys.argv[1:]]
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
