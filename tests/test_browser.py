"""The real thing in a real browser: `streamlit run app/main.py` with its embedded engine
(tiny model), Debian's chromium driven by playwright. Submit a prompt through the page, wait
for the canvas to draw used blocks, scrub back in time and return to live, click a block to
filter the log, save a screenshot; then stopping Streamlit stops the engine too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.waiting import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOT = ROOT / "out" / "test_browser.png"


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


@pytest.fixture
def app_url():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app/main.py", "--server.headless", "true",
         "--server.port", str(port), "--browser.gatherUsageStats", "false", "--", "--model", "tiny"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield f"http://127.0.0.1:{port}", proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


@pytest.mark.slow
def test_submit_a_prompt_and_watch_blocks_allocate(app_url):
    from playwright.sync_api import expect, sync_playwright

    url, streamlit = app_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1400})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        # the embedded engine starts, then the grid draws the empty pool
        page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.n === 256", timeout=120_000)
        assert page.evaluate("window.__kvscope_grid.used") == 0
        sidebar = page.get_by_test_id("stSidebar")
        sidebar.get_by_label("Prompt").fill("Tell me how a paged KV cache hands out blocks.")
        sidebar.get_by_label("max tokens").fill("300")
        sidebar.get_by_text("More", exact=True).click()
        sidebar.get_by_text("Ignore end of text").click()
        sidebar.get_by_role("button", name="Submit").click()
        page.wait_for_function("window.__kvscope_grid.used > 0 && window.__kvscope_grid.live", timeout=30_000)
        grid = page.evaluate("window.__kvscope_grid")
        assert grid["draws"] > 1
        SHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOT))
        assert SHOT.stat().st_size > 20_000

        # the event log lists the allocations; clicking block 0 filters the log to it
        page.wait_for_function("window.__kvscope_grid.used === 0", timeout=60_000)  # finished: blocks freed
        canvas = page.locator("canvas.grid").first
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
        track.scroll_into_view_if_needed()
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
