"""Fixtures of the dashboard's integration tests: a real engine server (tiny model, its own
process, recording what it sends), an independent client observing it, and the app under
AppTest on it. Each test module gets its own engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from kvscope_contract import protocol as p
from app.link.client import EngineClient
from app.link.launcher import ServerProcess
from tests.apptest import DEFAULT_POOL, MAIN, grid_data
from tests.waiting import wait


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rec") / "session.jsonl"


@pytest.fixture(scope="module")
def engine(recording):
    proc = ServerProcess("engine.serve.server", ["--model", "tiny", "--port", "0", "--record", str(recording)]).start()
    assert proc.wait_ready(90), "\n".join(proc.tail(30))
    yield proc
    proc.stop()


@pytest.fixture
def observer(engine):
    """An independent client: the engine's effects, as the protocol reports them."""
    c = EngineClient(engine.url)
    wait(lambda: c.view() is not None, what="the observer's first snapshot")
    for cmd in (p.Resume(), p.Pace(step_delay_ms=0), p.ResetCmd(config=DEFAULT_POOL)):
        assert isinstance(c.wait_reply(c.send(cmd)), p.Ack)
    wait(lambda: c.view().mirror.config.num_device_blocks == 256 and not c.view().mirror.state.seqs)
    yield c
    c.close()


@pytest.fixture
def at(engine, observer, monkeypatch):
    monkeypatch.setenv("KVSCOPE_ENGINE", engine.url)
    st.cache_resource.clear()  # a fresh app client per test (the old one is released)
    app = AppTest.from_file(MAIN, default_timeout=30)
    app.run()
    wait(lambda: grid_data(app.run()), what="the app's first grid")
    yield app
    st.cache_resource.clear()
