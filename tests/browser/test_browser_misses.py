"""The "why not more?" panel in a real browser (issue 26): the dashboard replays a recording in which
the prefix cache misses for every reason (tests/miss_recording.py: the real scheduler and block
manager); the hit-rate chip opens the panel, which names each reason with its tokens, travels to an
eviction with its blocks ringed, and says what would have hit from a lab replay of the session."""
from __future__ import annotations

import pytest

from tests.miss_recording import write
from tools.launch import CHROMIUM, FLAGS, ROOT, open_grid

SHOT = ROOT / "out" / "test_browser_misses.png"


@pytest.fixture
def replay_url(tmp_path, start_app):
    rec = tmp_path / "every_reason.jsonl"
    write(rec)
    return start_app(["--replay", str(rec), "--speed", "4"])[0]


def said(page, words: str, timeout: int = 30_000) -> None:
    try:
        page.wait_for_function("w => document.body.innerText.includes(w)", arg=words, timeout=timeout)
    except Exception:
        raise AssertionError(f"{words!r} not shown; the page says:\n{page.inner_text('body')[-3000:]}") from None


def run_to(page, stop: str, tries: int = 12) -> None:
    """Run to the next key event (a prefix hit or a preemption) until the stop's line says `stop`:
    the replay loops, so every stop comes round."""
    side = page.get_by_test_id("stSidebar")
    for _ in range(tries):
        side.get_by_role("button", name="Run to the next key event", exact=True).click()
        page.wait_for_timeout(1000)
        page.wait_for_function("!document.body.innerText.includes('running until')", timeout=60_000)
        page.wait_for_timeout(1000)
        if stop in page.inner_text("body"):
            return
    raise AssertionError(f"no stop at {stop!r}; the page says:\n{page.inner_text('body')[:3000]}")


def remove_chip(side, label: str, tries: int = 8) -> None:
    """Remove a kind from the key events to stop at, until its chip is gone. The chip is in an
    expander in the engine panel, a fragment redrawn every second: a rerun on a busy machine may
    draw the expander closed again, it may be still opening when looked at (a click then closes
    it), and a click on the chip may be lost to a redraw (CI's kept "evicted" once). So: open it
    until the chip shows, click, and again until the chip has left the page."""
    chip = side.get_by_role("button", name=f"Remove {label}", exact=True)
    clicked = False
    for _ in range(tries):
        if not chip.is_visible():
            if clicked and chip.count() == 0:
                return  # a click taken late
            side.get_by_text("Key events to stop at").click()
        try:
            chip.click(timeout=15_000)
            clicked = True
            chip.wait_for(state="detached", timeout=10_000)
            return
        except Exception:  # playwright's TimeoutError: not shown, or not taken
            continue
    raise AssertionError(f"the chip {label!r} was not removed from the key events' expander")


@pytest.mark.slow
def test_each_reason_is_shown_and_an_eviction_is_travelled_to(replay_url):
    from playwright.sync_api import sync_playwright
    from app.panels.misses import LABELS
    from kvscope_contract.kinds import KINDS

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, replay_url, errors, 20, height=1500, timeout_ms=120_000)
        side = page.get_by_test_id("stSidebar")
        side.get_by_role("button", name="Pause", exact=True).click()
        for kind in ("fork", "cow", "evict", "swap_out", "swap_in"):  # stop at prefix hits and preemptions
            remove_chip(side, KINDS[kind].label)
        page.get_by_role("button", name="Why not more?").click()
        # at long1's admission after its preemption, the reasons since the reset (caching on)
        run_to(page, "long1 reuses")
        said(page, "tokens looked up hit")
        for reason in ("evicted", "cold", "diverged", "partial_block", "recomputed"):
            said(page, f"{LABELS[reason]} ")
        said(page, "tokens with 2× blocks", 120_000)  # the lab's replay of this session
        said(page, "A replay of this session's")
        SHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOT), full_page=True)

        # an eviction before reuse: selecting it travels there and rings its blocks
        table = page.get_by_test_id("stDataFrame").filter(has_text="needed by").first
        table.scroll_into_view_if_needed()
        box = table.bounding_box()
        page.mouse.click(box["x"] + 14, box["y"] + 35 + 17)  # the first row's selection box
        page.wait_for_function("window.__kvscope_grid.live === false && window.__kvscope_grid.highlight > 0",
                               timeout=20_000)
        said(page, "again-2 needed tokens 0-8 again")

        # the hybrid pool: the prompt again hits only as far as its sliding window still has a run
        run_to(page, "hybrid-b reuses")
        said(page, f"{LABELS['window']} 16")

        # the pool without prefix caching, at its preemption: every token missed for that
        run_to(page, "no-cache1 preempted")
        said(page, "Prefix caching is off")
        said(page, f"{LABELS['caching_off']} 20")  # no-cache0 and no-cache1, 10 tokens each
        assert not errors, errors
        browser.close()
