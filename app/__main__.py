"""`kvscope [ARGS]` (or `python -m app`): the dashboard, as `streamlit run app/main.py -- ARGS`.

ARGS are the dashboard's own (app/link/source.py): `--engine ws://...`, `--replay FILE`, or flags
for the embedded engine; `--share` listens beyond loopback, for a room of viewers and a presenter.
Streamlit's options come from the environment (STREAMLIT_SERVER_PORT=...).
"""
from __future__ import annotations

import os
import sys

from app.streamlit_argv import share, streamlit_argv


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):  # say how to use it, start nothing
        from app.link.source import parser
        parser(prog="kvscope").print_help()
        return
    args, options = share(sys.argv[1:], os.environ)  # os.environ: what execv hands on
    os.execv(sys.executable, streamlit_argv(sys.executable, args, *options))


if __name__ == "__main__":
    main()
