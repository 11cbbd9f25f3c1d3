"""Every socket checks who talks to it (kvscope_contract/access.py, docs/security.md): an engine
server refuses a web page (any Origin) and, without a token, a Host that is no loopback name; the
launcher hands its child a random token in the environment, never in argv; a view token reads and
never commands; the lane takes only its own page, closes a connection that names no element in
time, and caps how many are open."""
from __future__ import annotations

import http.client
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from kvscope_contract import protocol as p
from app.link.client import EngineClient
from app.link.launcher import ServerProcess
from app.link.source import ASSETS
from app.panels import lane
from tests.processes import descendants
from tests.waiting import wait

DEMO = str(ASSETS / "demo_recording.jsonl")
TOKEN = "t0ken-of-the-launcher-" + "x" * 12


@pytest.fixture(scope="module")
def replay():
    """A replay server started as the dashboard starts its children: with a random token."""
    proc = ServerProcess("engine.serve.replay", [DEMO, "--port", "0", "--loop", "--view-token", "only-views"],
                         token=TOKEN).start()
    assert proc.wait_ready(60), "\n".join(proc.tail(30))
    yield proc
    proc.stop()


def _status(url: str, **options) -> int | None:
    """The HTTP status a handshake was refused with (None: it was accepted)."""
    try:
        connect(url, open_timeout=10, **options).close()
    except InvalidStatus as e:
        return e.response.status_code
    return None


def test_no_token_in_argv_or_in_the_log(replay):
    for pid in {replay.pid} | descendants(replay.pid):
        assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert TOKEN.encode() in Path(f"/proc/{pid}/environ").read_bytes()  # handed over there
    assert not any(TOKEN in line for line in replay.lines)


def test_a_web_page_is_refused_and_the_token_is_required(replay):
    auth = {"additional_headers": {"Authorization": f"Bearer {TOKEN}"}}
    assert _status(replay.url, origin="http://evil.example", **auth) == 403
    assert _status(replay.url, origin=f"http://127.0.0.1:{replay.url.rsplit(':', 1)[1].rstrip('/')}", **auth) == 403
    assert _status(replay.url) == 401
    assert _status(replay.url, **auth) is None


def test_a_view_token_reads_and_never_commands(replay):
    viewer, driver = EngineClient(replay.url, "only-views"), EngineClient(replay.url, TOKEN)
    try:
        wait(lambda: viewer.view() is not None and driver.view() is not None, what="both clients' snapshots")
        refused = viewer.wait_reply(viewer.send(p.Pause()), 15)
        assert isinstance(refused, p.Error) and "only views" in refused.message
        assert not driver.loop.paused
        assert isinstance(driver.wait_reply(driver.send(p.Pause()), 15), p.Ack)
        assert isinstance(driver.wait_reply(driver.send(p.Resume()), 15), p.Ack)
    finally:
        viewer.close()
        driver.close()


def test_without_a_token_only_loopback_hosts_are_served():
    proc = ServerProcess("engine.serve.replay", [DEMO, "--port", "0", "--loop"]).start()
    try:
        assert proc.wait_ready(60), "\n".join(proc.tail(30))
        port = int(proc.url.rsplit(":", 1)[1].rstrip("/"))
        for host, refused in (("rebound.example:80", True), (f"localhost:{port}", False), (f"127.0.0.1:{port}", False)):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/metrics", headers={"Host": host})
            status = c.getresponse().status
            c.close()
            assert (status == 403) == refused, (host, status)
        assert _status(proc.url) is None  # the dashboard's own client, as before
    finally:
        proc.stop()


class _Element:
    lane_open = True

    def serve(self, sync: dict) -> bytes | None:
        return b"frame"


def test_the_lane_takes_only_its_page_closes_the_silent_and_caps_connections(monkeypatch):
    server, element = lane.LaneServer("127.0.0.1"), _Element()
    url = f"ws://127.0.0.1:{server.port}/"
    page = {"origin": "http://127.0.0.1:8501"}  # Streamlit's port: the lane is the same host's
    assert _status(url) == 403  # no Origin: no browser page
    assert _status(url, origin="http://evil.example:8501") == 403
    with connect(url, **page) as ws:  # the page names its element, then asks
        ws.send(server.token(element))
        ws.send('{"pull": 1}')
        assert ws.recv(timeout=10) == b"frame"
    started = time.monotonic()
    with connect(url, **page) as silent:
        with pytest.raises(ConnectionClosed) as closed:
            silent.recv(timeout=lane.TOKEN_WAIT_S + 30)
    assert closed.value.rcvd.code == 4408 and time.monotonic() - started < lane.TOKEN_WAIT_S + 30
    monkeypatch.setattr(lane, "MAX_CONNECTIONS", 2)
    held = [connect(url, **page) for _ in range(2)]
    try:
        wait(lambda: server.connections == 2, what="two connections counted")
        assert _status(url, **page) == 503
    finally:
        for ws in held:
            ws.close()
    wait(lambda: server.connections == 0, what="their closes counted")
    assert _status(url, **page) is None
