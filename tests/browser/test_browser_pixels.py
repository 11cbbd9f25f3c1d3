"""The canvases keep their pixels between frames and recolour only the blocks a delta names
(assets/grid.js `paintPixels`): after many deltas of a busy engine, what they show must equal a
paint from scratch: in the overview beside a zoomed region (several blocks a pixel), in the whole
pool drawn a block a pixel, and on the host canvas; with "colour by" switched too."""
from __future__ import annotations

import time

import pytest

from app.data.launcher import ServerProcess
from tools.launch import CHROMIUM, FLAGS, open_grid

BLOCKS = 1 << 18


@pytest.fixture(scope="module")
def busy_engine():
    eng = ServerProcess("engine.synthetic", [
        "--port", "0", "--num-device-blocks", str(BLOCKS), "--num-host-blocks", "8192", "--fill", "0.5",
        "--warm-steps", "0", "--live", "256", "--max-num-seqs", "128", "--step-delay-ms", "20"]).start()
    assert eng.wait_ready(300), "\n".join(eng.tail(30))
    yield eng
    eng.stop()


def test_kept_pixels_equal_a_fresh_paint_after_many_deltas(busy_engine, start_app):
    from playwright.sync_api import sync_playwright

    url, _ = start_app(["--engine", busy_engine.url])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, url, errors, BLOCKS, height=1300)
        grid = lambda: page.evaluate("window.__kvscope_grid")  # noqa: E731
        differ = lambda: page.evaluate("window.__kvscope_grid_api.keptPixelsDiffer()")  # noqa: E731
        assert grid()["count"] < BLOCKS and grid()["overviewPerPixel"] > 1  # a zoomed region, an overview's heat
        views = 0
        for setup in ("", "Home", "state"):  # the overview; the whole pool as pixels; coloured by state
            if setup == "Home":
                page.locator("canvas.main").click(position={"x": 5, "y": 5})
                page.keyboard.press("Home")
                page.wait_for_function(f"window.__kvscope_grid.count === {BLOCKS}", timeout=10_000)
                assert grid()["cell"] < 5  # pixels, not cells
            elif setup:
                page.locator(f".bar button[data-m='{setup}']").click()
            for _ in range(4):
                start = grid()
                page.wait_for_function(f"window.__kvscope_grid.draws >= {start['draws'] + 15} && "
                                       f"window.__kvscope_grid.seq > {start['seq']}", timeout=60_000)
                assert grid()["kind"] == "delta"
                assert differ() == [0, 0, 0], f"{setup or 'zoomed'}: kept pixels (overview, main, host) differ"
                views += 1
            time.sleep(0.5)
        assert views == 12 and not errors, errors
        browser.close()
