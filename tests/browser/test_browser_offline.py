"""A tool that runs offline asks nothing of another machine (issue 28: the page asked
fonts.gstatic.com for its tab icon). Chromium with every request off the machine blocked and
recorded: the dashboard replaying a recording, every view and mode opened, none is made."""
from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tools.launch import CHROMIUM, FLAGS, ROOT

LOCAL = {"127.0.0.1", "localhost", "[::1]", "::1"}


@pytest.mark.slow
def test_the_page_asks_nothing_of_another_machine(start_app):
    from playwright.sync_api import sync_playwright

    url, _ = start_app(["--replay", str(ROOT / "assets" / "demo_recording.jsonl")])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1300})
        asked, failed = [], []

        def route(r) -> None:
            host = urlsplit(r.request.url).hostname or ""
            if r.request.url.startswith(("data:", "blob:")) or host in LOCAL:
                r.continue_()
            else:  # the network is off: record and refuse
                asked.append(r.request.url)
                r.abort()
        page.route("**/*", route)
        page.on("requestfailed", lambda r: failed.append((r.url, r.failure)))
        page.goto(url)
        page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.n > 0", timeout=120_000)
        main = page.get_by_test_id("stMain")
        for panel in ("Event log", "Prefix tree", "Lifetimes", "Timeline"):
            main.get_by_text(panel, exact=True).first.click()
            page.wait_for_timeout(1500)
        side = page.get_by_test_id("stSidebar")
        for mode in ("Lessons", "Lab", "Explore"):
            side.get_by_text(mode, exact=True).first.click()
            page.wait_for_timeout(2000)
        assert not asked, asked
        # and nothing of its own failed (the requests refused above aside, and those a redraw cancels)
        assert not [(u, why) for u, why in failed if urlsplit(u).hostname in LOCAL and "ERR_ABORTED" not in why], failed
        browser.close()
