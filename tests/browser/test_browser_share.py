"""Safe to share, in Chromium. `streamlit run app/main.py` listens on loopback only, its lane and
its engine too (read from /proc, as `ss -ltn` does). Shared (Streamlit's address 0.0.0.0, as
`kvscope --share` sets it): a viewer's page has the live views and no control, nor the engine's
address, and travels in time on its own; the presenter's link gives its page every control, leaves
the address bar at once, and what the presenter does shows in the viewer's page, lessons included:
a viewer reads the presenter's lesson along, stop by stop, with no control of it."""
from __future__ import annotations

import secrets

from app.streamlit_argv import PRESENTER_KEY
from tests.processes import descendants, listening
from tools.launch import CHROMIUM, FLAGS, click_until, open_grid
from tools.shoot_docs import next_stop, walk_lesson

DRIVING = ("Connect", "Submit", "Pause", "Reset engine", "Clear prefix cache", "Clean slate", "Restart engine")


def _sockets(streamlit) -> list[tuple[str, int]]:
    return listening({streamlit.pid} | descendants(streamlit.pid))


def test_the_dashboard_its_lane_and_its_engine_listen_on_loopback_only(start_app):
    from playwright.sync_api import sync_playwright

    url, streamlit = start_app(["--replay", "demo_recording.jsonl"])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = open_grid(browser, url, [])  # its first redraw opens the lane
        page.wait_for_function("window.__kvscope_grid_api.lane() && window.__kvscope_grid_api.lane().ready",
                               timeout=60_000)

        sockets = _sockets(streamlit)
        browser.close()
    assert len({port for _, port in sockets}) >= 3, sockets  # Streamlit's, the lane's, the replay server's
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in sockets), f"beyond loopback: {sockets}"


def test_a_viewer_watches_and_only_the_presenter_drives(start_app):
    from playwright.sync_api import expect, sync_playwright

    key = secrets.token_urlsafe(24)
    url, streamlit = start_app(["--model", "tiny"], options=("--server.address", "0.0.0.0"),
                               env={PRESENTER_KEY: key})
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        viewer = open_grid(browser, url, errors, 256)
        side = lambda page: page.get_by_test_id("stSidebar")
        expect(side(viewer).get_by_text("You are viewing", exact=False)).to_be_visible()
        for name in DRIVING:
            expect(viewer.get_by_role("button", name=name, exact=True)).to_have_count(0)
        expect(side(viewer).get_by_text("Lab", exact=True)).to_have_count(0)
        expect(side(viewer).get_by_text("Connection", exact=True)).to_have_count(0)

        presenter = open_grid(browser, f"{url}/?presenter={key}", errors, 256)
        presenter.wait_for_function("!location.search.includes('presenter')", timeout=30_000)
        for name in ("Submit", "Pause"):
            expect(side(presenter).get_by_role("button", name=name, exact=True)).to_have_count(1, timeout=30_000)
        expect(side(presenter).get_by_text("Connection", exact=True)).to_have_count(1)
        side(presenter).get_by_role("button", name="Pause", exact=True).click()
        # what the presenter did, the room sees (the viewer's status line), still without controls
        viewer.wait_for_function("document.body.innerText.includes('paused')", timeout=60_000)
        side(presenter).get_by_role("button", name="Resume", exact=True).click()
        viewer.wait_for_function("!document.body.innerText.includes('paused')", timeout=60_000)
        for name in DRIVING:
            expect(viewer.get_by_role("button", name=name, exact=True)).to_have_count(0)

        # the presenter's prompt runs in the room's views; a viewer travels back on its own
        side(presenter).get_by_label("Prompt").fill("Tell me how a paged KV cache hands out blocks.")
        side(presenter).get_by_role("button", name="Submit").click()
        viewer.wait_for_function("window.__kvscope_grid.seq > 20", timeout=120_000)
        track = viewer.locator(".kv .travel .track").bounding_box()
        viewer.mouse.click(track["x"] + track["width"] * 0.3, track["y"] + track["height"] / 2)
        viewer.wait_for_function("!window.__kvscope_grid.live", timeout=30_000)
        assert presenter.evaluate("window.__kvscope_grid.live"), "a viewer's time travel moved the presenter's page"

        # a lesson: the presenter drives it, the viewer reads it along (the stop the presenter shows)
        walk_lesson(presenter, "1. Block tables and on-demand allocation", 1, timeout_ms=120_000)
        side(viewer).get_by_text("Lessons", exact=True).click()
        viewer.wait_for_function("document.body.innerText.includes('stop 1 of 5') && "
                                 "document.body.innerText.includes('Admission, on demand')", timeout=60_000)
        expect(side(viewer).get_by_text("The presenter's lesson", exact=False)).to_be_visible()
        for name in ("Next", "Back", "Restart", "Start the lesson"):
            expect(viewer.get_by_role("button", name=name, exact=True)).to_have_count(0)
        expect(side(viewer).get_by_label("Lesson")).to_have_count(0)
        next_stop(presenter, 2, timeout_ms=120_000)
        viewer.wait_for_function("document.body.innerText.includes('stop 2 of 5') && "
                                 "document.body.innerText.includes('One decode step')", timeout=120_000)
        click_until(presenter, side(presenter).get_by_role("button", name="Back"),  # reached before: both travel to it
                    "() => document.body.innerText.includes('stop 1 of 5')")
        viewer.wait_for_function("document.body.innerText.includes('stop 1 of 5') && !window.__kvscope_grid.live",
                                 timeout=30_000)
        side(viewer).get_by_text("Explore", exact=True).click()

        engine = next(line for line in viewer.evaluate("document.body.innerText").splitlines() if "Connected" in line)
        assert "ws://" not in engine and "ws://" in presenter.evaluate("document.body.innerText")
        for page in (viewer, presenter):  # the key is in no page, the presenter's included
            assert key not in page.content() and key not in page.url
        sockets = _sockets(streamlit)
        browser.close()
    assert not errors, errors
    wide = {port for addr, port in sockets if addr in ("0.0.0.0", "::")}
    assert len(wide) >= 2, sockets  # Streamlit's and the lane's: the room reaches both
    assert len(sockets) > len(wide), sockets  # the engine stays on loopback
