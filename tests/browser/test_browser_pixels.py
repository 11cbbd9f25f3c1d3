"""The canvases keep their pixels between frames and recolour only the blocks a delta names
(assets/grid.js `paintPixels`): after many deltas of a busy engine, what they show must equal a
paint from scratch: in the overview beside a zoomed region (several blocks a pixel), in the whole
pool drawn a block a pixel, and on the host canvas; with "colour by" switched (by KV-cache
group too, on a hybrid pool), and across a jump in time and back."""
from __future__ import annotations

import time

import pytest

from app.link.launcher import ServerProcess
from tools.launch import CHROMIUM, FLAGS, open_grid

BLOCKS = 1 << 18


@pytest.fixture(scope="module", params=[None, 64], ids=["one-group", "hybrid"])
def busy_engine(request):
    """A busy pool; `hybrid`: Gemma 3's six KV-cache groups (sliding windows of 64 tokens), whose
    grid can be coloured by group."""
    window = ["--window", str(request.param)] if request.param else []
    eng = ServerProcess("engine.synthetic", [
        "--port", "0", "--num-device-blocks", str(BLOCKS), "--num-host-blocks", "8192", "--fill", "0.5",
        "--warm-steps", "0", "--live", "256", "--max-num-seqs", "128", "--step-delay-ms", "20", *window]).start()
    assert eng.wait_ready(300), "\n".join(eng.tail(30))
    yield eng, bool(window)
    eng.stop()


@pytest.mark.slow
def test_kept_pixels_equal_a_fresh_paint_after_many_deltas(busy_engine, start_app):
    from playwright.sync_api import sync_playwright

    engine, hybrid = busy_engine
    url, _ = start_app(["--engine", engine.url])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, url, errors, BLOCKS, height=1300)
        grid = lambda: page.evaluate("window.__kvscope_grid")  # noqa: E731
        differ = lambda: page.evaluate("window.__kvscope_grid_api.keptPixelsDiffer()")  # noqa: E731
        assert grid()["count"] < BLOCKS and grid()["overviewPerPixel"] > 1  # a zoomed region, an overview's heat
        views = 0
        colourings = ("state", "group") if hybrid else ("state",)
        for setup in ("", "Home", *colourings):  # the overview; the whole pool as pixels; another colouring
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
        # a jump back in time and the way back to live: deltas naming most blocks (painted afresh)
        track = page.locator(".kv .travel .track").bounding_box()
        live = grid()["seq"]
        page.mouse.click(track["x"] + 3, track["y"] + track["height"] / 2)
        page.wait_for_function(f"!window.__kvscope_grid.live && window.__kvscope_grid.seq < {live}", timeout=30_000)
        assert differ() == [0, 0, 0], "after travelling back"
        page.locator(".kv .golive").click()
        page.wait_for_function(f"window.__kvscope_grid.live && window.__kvscope_grid.seq > {live}", timeout=30_000)
        assert differ() == [0, 0, 0], "back at live"
        assert views == 4 * (2 + len(colourings)) and not errors, errors
        browser.close()
