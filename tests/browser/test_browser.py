"""The real thing in a real browser: `streamlit run app/main.py` with its embedded engine
(tiny model), Debian's chromium driven by playwright. Submit a prompt through the page, wait
for the canvas to draw used blocks, scrub back in time and return to live, click a block to
filter the log, save a screenshot; then stopping Streamlit stops the engine too."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from tools.launch import CHROMIUM, FLAGS, ROOT, open_grid, reset_pool
from tests.processes import children

SHOT = ROOT / "out" / "test_browser.png"


@pytest.mark.slow
def test_submit_a_prompt_and_watch_blocks_allocate(app_url):
    from playwright.sync_api import expect, sync_playwright

    url, streamlit = app_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, url, errors, 256)  # the embedded engine starts, then the grid draws the empty pool
        assert page.evaluate("window.__kvscope_grid.used") == 0
        sidebar = page.get_by_test_id("stSidebar")
        # Paused, so the blocks stay in use until the test has seen them (a busy machine may
        # pull grid frames more slowly than the tiny model finishes a request)
        sidebar.get_by_role("button", name="Pause", exact=True).click()
        sidebar.get_by_role("button", name="Resume", exact=True).wait_for(timeout=30_000)
        sidebar.get_by_label("Prompt").fill("Tell me how a paged KV cache hands out blocks.")
        sidebar.get_by_label("max tokens").fill("300")
        sidebar.get_by_text("More", exact=True).click()
        sidebar.get_by_text("Ignore end of text").click()
        sidebar.get_by_role("button", name="Submit").click()
        # the engine's ack comes back as a toast "Submit: <sequence id>": the request is queued
        page.wait_for_function("document.body.innerText.includes('Submit: ')", timeout=60_000)
        for attempt in range(10):  # Step runs the prefill of the queued request: blocks allocated
            sidebar.get_by_role("button", name="Step", exact=True).click(timeout=90_000)
            try:
                page.wait_for_function("window.__kvscope_grid.used > 0 && window.__kvscope_grid.live", timeout=6_000)
                break
            except Exception:
                if attempt == 9:
                    raise AssertionError(f"no block in use after 10 steps; the page "
                                         f"says:\n{page.inner_text('body')[:3000]}")
        grid = page.evaluate("window.__kvscope_grid")
        assert grid["draws"] > 1
        SHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOT))
        assert SHOT.stat().st_size > 20_000

        # the event log lists the allocations; clicking block 0 filters the log to it
        sidebar.get_by_role("button", name="Resume", exact=True).click()
        page.wait_for_function("window.__kvscope_grid.used === 0", timeout=60_000)  # finished: blocks freed
        canvas = page.locator("canvas.main").first
        box = canvas.bounding_box()
        page.mouse.click(box["x"] + 4, box["y"] + 4)  # block 0: the first one allocated
        page.wait_for_function("[...document.querySelectorAll('input[aria-label=Block]')]"
                               ".map(e => e.value).join() === '0'", timeout=10_000)

        # choosing an event in the log travels there; Live returns
        log = page.get_by_test_id("stDataFrame").first
        log.scroll_into_view_if_needed()
        lb = log.bounding_box()
        page.mouse.click(lb["x"] + 14, lb["y"] + 35 + 17)  # the first row's selection box
        page.wait_for_function("window.__kvscope_grid.live === false", timeout=10_000)
        page.get_by_role("button", name="Live").click()
        page.wait_for_function("window.__kvscope_grid.live === true", timeout=10_000)

        # scrub back to the middle of the run: the grid shows that moment, then back to live
        track = page.locator(".scrub .track")
        track.evaluate("e => e.scrollIntoView({block: 'center'})")  # not under Streamlit's sticky header
        tb = track.bounding_box()
        page.mouse.click(tb["x"] + tb["width"] * 0.5, tb["y"] + tb["height"] / 2)
        page.wait_for_function("window.__kvscope_grid.live === false", timeout=10_000)
        expect(page.get_by_text("Time travel", exact=False).first).to_be_visible()
        page.get_by_role("button", name="Live").click()
        page.wait_for_function("window.__kvscope_grid.live === true", timeout=10_000)
        assert not errors, errors
        browser.close()

    engines = children(streamlit.pid)
    assert engines, "the embedded engine should be a child of streamlit"
    streamlit.send_signal(signal.SIGTERM)
    streamlit.wait(timeout=20)
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in engines if Path(f"/proc/{pid}/stat").exists()
             and (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]
    assert not alive, f"engine processes outlived streamlit: {alive}"


def engine_of(streamlit_pid: int) -> int:
    (pid,) = children(streamlit_pid)
    return pid


@pytest.mark.slow
def test_two_tabs_follow_the_engine_and_a_killed_engine_restarts_with_its_pool(app_url):
    """Issue 8, bugs 3 and 4 in a browser: what one tab does to the engine shows in the other's
    sidebar without touching it; kill -9 the engine: both say so, Restart brings its pool back."""
    from playwright.sync_api import expect, sync_playwright

    url, streamlit = app_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        one, two = (browser.new_page(viewport={"width": 1500, "height": 1400}) for _ in range(2))
        errors: list[str] = []
        for page in (one, two):
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.n === 256", timeout=120_000)
        side = lambda page: page.get_by_test_id("stSidebar")
        side(one).get_by_role("button", name="Pause", exact=True).click()
        expect(side(two).get_by_role("button", name="Resume", exact=True)).to_be_visible(timeout=10_000)
        expect(side(two).get_by_role("button", name="Step", exact=True)).to_be_enabled()
        side(one).get_by_role("button", name="Shared system prompt", exact=True).click()
        # The sidebar redraws on its own, no rerun asked by this tab: its Abort list fills. Opening
        # the list runs nothing; it is opened again until the requests show (a redraw may land
        # on the click and close it).
        deadline = time.monotonic() + 20
        while True:
            side(two).get_by_role("combobox", name="Request").click()
            try:
                expect(two.get_by_role("option").filter(has_text="sys").first).to_be_visible(timeout=2_000)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
            finally:
                two.keyboard.press("Escape")
        side(one).get_by_role("button", name="Resume", exact=True).click()
        try:
            expect(side(two).get_by_role("button", name="Pause", exact=True)).to_be_visible(timeout=10_000)
        except AssertionError:  # whose side was it: the tab that clicked, or the one that follows?
            print("the tab that clicked Resume:", side(one).inner_text(), sep="\n")
            raise
        reset_pool(one, 512)
        expect(side(two).get_by_text("Pool: 512 blocks × 16 tokens")).to_be_visible(timeout=30_000)
        two.wait_for_function("window.__kvscope_grid.n === 512", timeout=15_000)

        os.kill(engine_of(streamlit.pid), signal.SIGKILL)
        for page in (one, two):
            expect(page.get_by_text("died", exact=False).first).to_be_visible(timeout=15_000)
            page.wait_for_function("window.__kvscope_grid.connected === false", timeout=15_000)
        one.get_by_test_id("stMain").get_by_role("button", name="Restart engine", exact=True).click()
        for page in (one, two):  # a new engine process loads the model again; the grids mount afresh
            page.wait_for_function("window.__kvscope_grid.connected && window.__kvscope_grid.n === 512",
                                   timeout=240_000)
        assert not errors, errors
        browser.close()


GRID_ERRORS = ("could not draw", "failed to draw", "Failed to process", "Cached ForwardMsg MISS")


def follow_redraws(page, frames: int, errors: list[str], what: str, timeout: int = 60_000) -> dict:
    """Watch the grid draw `frames` more frames whose event number advances, checking after each
    that no panel says it failed: the deltas of a run, not only its first frame."""
    seen = page.evaluate("window.__kvscope_grid")
    for _ in range(frames):
        try:
            page.wait_for_function(f"window.__kvscope_grid.seq > {seen['seq']}", timeout=timeout)
        except Exception:
            raise AssertionError(f"{what}: the grid stopped at event {seen['seq']}; the page says:\n"
                                 f"{page.inner_text('body')[:3000]}") from None
        seen = page.evaluate("window.__kvscope_grid")
        body = page.inner_text("body")
        assert not any(e in body for e in GRID_ERRORS), f"{what}: {body[:3000]}"
    assert not errors, errors
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("app_url", [["--model", "tiny", "--num-host-blocks", "0", "--step-delay-ms", "40"]],
                         indirect=True)
def test_a_pool_without_host_blocks_and_a_pool_of_one_block_draw_frame_after_frame(app_url):
    """Issue 17, item 1: with no host blocks (every vLLM pool) the grid drew its first frame, then
    "createImageData ... not of type 'long'" and "cannot reshape array of size 0" on every delta,
    and the page froze. Many redraws of a busy run, then of a pool of one block."""
    from playwright.sync_api import sync_playwright

    url, _ = app_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, url, errors, 256)
        assert page.evaluate("window.__kvscope_grid.m") == 0
        sidebar = page.get_by_test_id("stSidebar")
        sidebar.get_by_label("Pace (ms between steps)")  # the engine panel is there
        start, advanced = page.evaluate("window.__kvscope_grid"), 0
        presets = ["Shared system prompt", "Overload the pool", "Parallel sampling (n=4)", "Long and short mixed"]
        for run in range(16):  # until 30 frames of new events were drawn (paced: a preset lasts a while)
            sidebar.get_by_role("button", name=presets[run % len(presets)], exact=True).click()
            while advanced < 30:
                try:
                    last = follow_redraws(page, 1, errors, presets[run % len(presets)], timeout=15_000)
                except AssertionError as e:
                    if "stopped at event" not in str(e):
                        raise
                    break  # the preset is done: the next one
                advanced += 1
            if advanced >= 30:
                break
        assert advanced >= 30 and last["kind"] == "delta" and last["seq"] > start["seq"]
        for panel in ("Event log", "Prefix tree", "Lifetimes", "Timeline"):  # every view of the page
            page.get_by_test_id("stMain").get_by_text(panel, exact=True).first.click()
            # new events to follow (a click on a redrawing sidebar may be lost)
            for attempt, preset in enumerate(presets):
                sidebar.get_by_role("button", name=preset, exact=True).click()
                try:
                    follow_redraws(page, 2, errors, panel, timeout=20_000)
                    break
                except AssertionError as e:
                    if "stopped at event" not in str(e) or attempt == len(presets) - 1:
                        raise

        reset_pool(page, 1)
        assert page.evaluate("window.__kvscope_grid.m") == 0
        sidebar.get_by_label("Prompt").fill("Hi")
        sidebar.get_by_label("max tokens").fill("8")
        sidebar.get_by_text("More", exact=True).click()
        sidebar.get_by_text("Chat template").click()  # off: "Hi" and 8 tokens fit one block of 16
        for _ in range(2):  # each request: blocks taken, tokens written, the block freed or cached
            sidebar.get_by_role("button", name="Submit").click()
            follow_redraws(page, 2, errors, "a pool of one block")
        browser.close()


@pytest.mark.slow
@pytest.mark.parametrize("app_url", [["--model", "tiny", "--num-device-blocks", "48", "--num-host-blocks", "12",
                                      "--max-num-seqs", "6"]], indirect=True)
def test_the_reset_form_of_every_fresh_tab_shows_the_engines_pool(app_url):
    """Issue 17, item 2: in most fresh tabs the Reset pool form showed 1 device block, 0 host
    blocks, max running 1 (the widgets' minimums), and Reset engine applied them."""
    from playwright.sync_api import sync_playwright

    url, _ = app_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        for tab in range(4):
            page = open_grid(browser, url, errors, 48)
            page.wait_for_timeout(3_000)  # the fragments' timers run a few times first
            side = page.get_by_test_id("stSidebar")
            side.get_by_text("Reset pool").click()
            shown = [side.get_by_label(label).input_value() for label in ("Device blocks", "Host blocks",
                                                                          "Max running")]
            assert shown == ["48", "12", "6"], f"tab {tab}: {shown}"
            page.close()
        assert not errors, errors
        browser.close()
