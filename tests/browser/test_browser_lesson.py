"""A lesson walked in a real browser: `streamlit run app/main.py` with its embedded engine (tiny
model), Debian's chromium through playwright. Lessons mode, the first lesson started and run to
its end with Next alone; each stop's caption shows and the grid rings its blocks; Back travels
to a stop reached before."""
from __future__ import annotations


import pytest

from tools.launch import ROOT, click_until
from tools.shoot_docs import next_stop, open_dashboard, walk_lesson

SHOT = ROOT / "out" / "test_browser_lesson.png"


@pytest.mark.slow
def test_walk_a_lesson_with_next_and_back(app_url):
    from playwright.sync_api import sync_playwright

    url, _ = app_url
    with sync_playwright() as pw:
        browser, page, errors = open_dashboard(pw, url, height=1400, timeout_ms=120_000)
        walk_lesson(page, "1. Block tables and on-demand allocation", 1, timeout_ms=60_000)
        text = page.inner_text("body")
        assert "Admission, on demand" in text and "block table, logical → physical" in text
        page.wait_for_function("window.__kvscope_grid.n === 24 && window.__kvscope_grid.highlight > 0",
                               timeout=20_000)  # the lesson's own pool, its blocks ringed
        for n in range(2, 6):
            next_stop(page, n, timeout_ms=60_000)
        # the card is sent element by element: its last caption may follow its title line
        page.wait_for_function("document.body.innerText.includes('End of the lesson')", timeout=20_000)
        SHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOT))
        click_until(page, page.get_by_test_id("stSidebar").get_by_role("button", name="Back"),
                    "() => { const t = document.body.innerText; "
                    "return t.includes('stop 4 of 5') && t.includes('a stop reached earlier'); }")
        page.wait_for_function("window.__kvscope_grid.live === false", timeout=20_000)
        assert not errors, errors
        browser.close()
