"""The live views' lane (app/panels/lane.py) in Chromium, on a busy engine: the live views redraw by
it, without a Streamlit rerun; time travel closes it and no live frame then overwrites the
event travelled to; Live opens it again; and a page that cannot reach it (a proxy that forwards
only Streamlit's port) redraws through Streamlit, as before. Frames are counted on the wire."""
from __future__ import annotations

import re
import time

import pytest

from app.link.launcher import ServerProcess
from tools.launch import CHROMIUM, FLAGS, open_grid

BLOCKS = 8192
LANE_URL = re.compile(r"^ws://[^/]+:\d+/$")  # Streamlit's own is .../_stcore/stream


@pytest.fixture(scope="module")
def busy_engine():
    eng = ServerProcess("engine.synthetic", [
        "--port", "0", "--num-device-blocks", str(BLOCKS), "--num-host-blocks", "1024", "--fill", "0.5",
        "--live", "128", "--max-num-seqs", "64", "--step-delay-ms", "20"]).start()
    assert eng.wait_ready(300), "\n".join(eng.tail(30))
    yield eng
    eng.stop()


class Wire:
    """Frames that reached the page by the lane (binary: the grid's)."""

    def __init__(self, page):
        self.lane = 0
        page.on("websocket", lambda ws: LANE_URL.match(ws.url) and ws.on("framereceived", self.received))

    def received(self, payload) -> None:
        self.lane += isinstance(payload, bytes)


def grid(page) -> dict:
    return page.evaluate("window.__kvscope_grid")


FRAMES_JS = "(window.__kvscope_msgs || []).length"  # every frame the grid received, either way


def redraws_in(page, wire: Wire, seconds: float) -> tuple[int, int, int, int]:
    """(draws, events advanced, frames the grid received, those by the lane) in `seconds`."""
    g0, frames0, lane0 = grid(page), page.evaluate(FRAMES_JS), wire.lane
    time.sleep(seconds)
    g1 = grid(page)
    return g1["draws"] - g0["draws"], g1["seq"] - g0["seq"], page.evaluate(FRAMES_JS) - frames0, wire.lane - lane0


def test_the_live_views_redraw_by_their_lane_and_without_it(busy_engine, start_app):
    from playwright.sync_api import sync_playwright

    url, _ = start_app(["--engine", busy_engine.url])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        wires: list[Wire] = []
        page = open_grid(browser, url, errors, BLOCKS, prepare=lambda pg: wires.append(Wire(pg)))
        page.wait_for_function("window.__kvscope_grid_api.lane() && window.__kvscope_grid_api.lane().ready",
                               timeout=60_000)
        draws, moved, frames, by_lane = redraws_in(page, wires[0], 3)
        assert draws >= 6 and moved > 0, f"{draws} draws in 3 s, events advanced {moved}"
        assert by_lane >= 0.8 * frames, f"{by_lane} of {frames} frames by the lane"

        # time travel: the lane closes, and nothing live overwrites the event travelled to
        track = page.locator(".kv .travel .track").bounding_box()
        page.mouse.click(track["x"] + track["width"] * 0.3, track["y"] + track["height"] / 2)
        page.wait_for_function("!window.__kvscope_grid.live", timeout=30_000)
        there = grid(page)["seq"]
        time.sleep(2)
        assert not grid(page)["live"] and grid(page)["seq"] == there, "a live frame overwrote the event travelled to"
        assert page.evaluate("window.__kvscope_grid_api.lane().open") is False
        page.locator(".kv .golive").click()
        page.wait_for_function("window.__kvscope_grid.live && window.__kvscope_grid_api.lane().open", timeout=30_000)
        draws, moved, frames, by_lane = redraws_in(page, wires[0], 3)
        assert by_lane >= 6 and by_lane >= 0.8 * frames and moved > 0, (draws, moved, frames, by_lane)

        # a page that cannot reach the lane redraws through Streamlit
        page.close()
        blocked = open_grid(browser, url, errors, BLOCKS, prepare=lambda pg: (
            wires.append(Wire(pg)), pg.route_web_socket(LANE_URL, lambda ws: ws.close())))
        draws, moved, frames, by_lane = redraws_in(blocked, wires[1], 4)
        assert by_lane == 0 and frames >= 4 and draws >= 4 and moved > 0, (draws, moved, frames, by_lane)
        assert blocked.evaluate("window.__kvscope_grid_api.lane()") is None
        assert not errors, errors
        browser.close()
