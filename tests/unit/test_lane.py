"""The live views' lane (app/panels/lane.py): a real WebSocket server and client, the element's
exchange (app/panels/grid.Element) when asks come by the lane and by Streamlit reruns alike, and
the one rule for when the lane may draw (Redraw.lane_may_draw), condition by condition."""
from __future__ import annotations

import gc
import json

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from kvscope_contract import protocol as p
from app.link.client import Redraw, Status
from app.panels import grid
from app.panels.lane import LaneServer
from tests.grid_canvas import canvas
from tests.histories import busy_history, view_at


PAGE = "http://127.0.0.1:8501"  # the dashboard's page, on Streamlit's port: the only Origin the lane takes


@pytest.fixture(scope="module")
def lane_server() -> LaneServer:
    s = LaneServer("127.0.0.1")
    assert s.port is not None
    return s


def test_an_element_answers_by_its_lane_and_says_when_a_rerun_must(lane_server):
    h, _ = busy_history(seed=5, ops=200)
    views = iter([view_at(h, n) for n in range(h.first_event + 20, h.last_event + 1, 10)])
    el = grid.Element()
    el.compose_lane = lambda sync: el.message(next(views), {}, sync, None, {}, grid.Profile())
    token = lane_server.token(el)
    assert lane_server.token(el) == token  # one token for the element's life
    with connect(f"ws://127.0.0.1:{lane_server.port}/", origin=PAGE) as ws:
        ws.send(token)
        held, have = {}, None
        for pull in range(1, 6):
            ws.send(json.dumps({"el": "a", "have": have, "pull": pull, "style": 1}))
            held, applied = canvas(held, ws.recv(timeout=10))
            assert applied
            have = held["token"]
        el.compose_lane = None  # a rerun closed the lane (time travel, a lesson, a paused engine)
        ws.send(json.dumps({"el": "a", "have": have, "pull": 6}))
        assert ws.recv(timeout=10) == "streamlit"
    assert el.lane_sync["pull"] == 6


def test_an_unknown_token_or_a_malformed_ask_closes_only_that_connection(lane_server):
    with connect(f"ws://127.0.0.1:{lane_server.port}/", origin=PAGE) as ws:
        ws.send("no-such-token")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 4404
    el = grid.Element()
    token = lane_server.token(el)
    with connect(f"ws://127.0.0.1:{lane_server.port}/", origin=PAGE) as ws:
        ws.send(token)
        ws.send("{not json")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    with connect(f"ws://127.0.0.1:{lane_server.port}/", origin=PAGE) as ws:  # the server serves on
        ws.send(token)
        ws.send(json.dumps({"pull": 1}))
        assert ws.recv(timeout=10) == "streamlit"


def test_a_session_that_ends_takes_its_lane_with_it(lane_server):
    el = grid.Element()
    token = lane_server.token(el)
    assert token in lane_server.elements
    del el
    gc.collect()
    assert token not in lane_server.elements


def test_a_heartbeat_rerun_answers_the_lanes_last_ask_not_streamlits_old_one():
    """Streamlit keeps the last ask it carried; while the lane redraws, a rerun (the fragment's
    heartbeat) must answer the newer ask that came by the lane, with a delta the canvas can
    apply, not a whole million-block frame for a canvas that moved on."""
    h, _ = busy_history(seed=6, ops=300)
    views = [view_at(h, n) for n in range(h.first_event + 20, h.last_event + 1, 7)]
    el, prof = grid.Element(), grid.Profile()
    streamlit_sync = {"el": "a", "have": None, "pull": 1, "style": 0}
    held, _ = canvas({}, el.message(views[0], {}, el.newest(streamlit_sync), None, {}, prof))
    pull = 1
    for i, view in enumerate(views[1:], 1):
        pull += 1
        ask = {"el": "a", "have": held["token"], "pull": pull, "style": 1}
        if i % 5:  # by the lane
            el.lane_sync = ask
            data = el.message(view, {}, ask, None, {}, prof)
        else:  # a heartbeat rerun, with the ask Streamlit last carried
            data = el.message(view, {}, el.newest(streamlit_sync), None, {}, prof)
        head, _ = grid.read(data)
        assert head["kind"] == "delta", f"redraw {i}: a whole frame for a canvas that holds one"
        held, applied = canvas(held, data)
        assert applied and held["dev"].tobytes() == grid.frame_of(view, {}).dev.records().tobytes()
    other_element = {"el": "b", "have": None, "pull": 1, "style": 0}  # a page drawn afresh asks by Streamlit first
    assert el.newest(other_element) is other_element


def a_redraw(*, travelled: bool = False, paused: bool = False, state: str = "connected") -> Redraw:
    """A redraw of a busy pool: the live event, or (`travelled`) one travelled to."""
    h, _ = busy_history(seed=8, ops=120)
    n = h.last_event - 10 if travelled else h.last_event
    return Redraw(view_at(h, n), h.first_event, h.last_event, (), p.LoopState(paused=paused, step_delay_ms=0.0),
                  Status(state=state), None, "ws://engine", {})


MAY = {"mode": "Explore", "pending": False, "died": False, "restarted": False}  # the session and process facts


def test_the_lane_draws_the_live_engine_running_and_connected_in_explore():
    assert a_redraw().lane_may_draw(**MAY)


@pytest.mark.parametrize("redraw, facts", [
    pytest.param({"paused": True}, {}, id="paused"),
    pytest.param({"state": "reconnecting"}, {}, id="disconnected"),
    pytest.param({}, {"died": True}, id="died"),
    pytest.param({}, {"restarted": True}, id="restarted"),
    pytest.param({}, {"pending": True}, id="pending command"),
    pytest.param({"travelled": True}, {}, id="travel"),
    pytest.param({}, {"mode": "Lessons"}, id="lesson"),
])
def test_the_lane_closes_when_a_redraw_needs_the_session(redraw, facts):
    """Each condition alone closes it (the rest as in the test above, which the lane draws)."""
    assert not a_redraw(**redraw).lane_may_draw(**{**MAY, **facts})
