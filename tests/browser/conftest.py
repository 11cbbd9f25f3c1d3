"""The browser tests' one way to start the app: `streamlit run app/main.py -- ARGS` headless on a
free port (tools/launch.py), its output in a log printed after the test, stopped after the test."""
from __future__ import annotations

import os
import signal

import pytest

from tools.launch import CHROMIUM, start_streamlit


@pytest.fixture
def start_app(tmp_path):
    """start_app(ARGS, options=..., env=...) -> (url, process) (tools/launch.start_streamlit);
    every app started is stopped after the test."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    started = []

    def start(args: list[str], **launch):
        log = tmp_path / f"streamlit-{len(started)}.log"
        with log.open("w") as out:
            proc, url = start_streamlit(args, out=out, **launch)
        started.append((proc, log))
        return url, proc

    yield start
    for proc, log in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        try:  # what it started in its process group (an embedded engine) goes with it
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        print(f"streamlit's output ({log}):\n" + log.read_text()[-4000:])


@pytest.fixture
def app_url(start_app, request):
    """The app on the tiny model's embedded engine, or on the arguments a test gives (indirect
    parametrize): (url, process)."""
    return start_app(getattr(request, "param", ["--model", "tiny"]))
