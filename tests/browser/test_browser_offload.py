"""Both tiers live in Chromium (issue 36): the tiny engine with a host tier; a prompt, then others
that push it out of the device pool, then the prompt again, whose blocks come back from the host
tier. The grid draws the host tier as its own region, filled as blocks are stored, with a load
outlined and said in the hover; the request's block table marks the blocks that came from the host
tier; "Why not more?" says they hit in the host tier, with what they cost."""
from __future__ import annotations

import pytest

from app.link.launcher import ServerProcess
from tests.protocol_client import Client
from tools.launch import CHROMIUM, FLAGS, ROOT, open_grid

SHOT = ROOT / "out" / "test_browser_offload.png"
DEVICE, TIER = 24, 48
SYSTEM = "You are a helpful assistant who answers briefly and precisely, in plain words. " * 2


@pytest.fixture
def engine():
    eng = ServerProcess("engine.serve.server", [
        "--port", "0", "--model", "tiny", "--block-size", "4", "--num-device-blocks", str(DEVICE),
        "--num-host-blocks", "0", "--host-blocks", str(TIER), "--preemption-mode", "recompute"]).start()
    assert eng.wait_ready(300), "\n".join(eng.lines)
    yield eng
    eng.stop()


def said(page, words: str, timeout: int = 60_000) -> None:
    try:
        page.wait_for_function("w => document.body.innerText.includes(w)", arg=words, timeout=timeout)
    except Exception:
        raise AssertionError(f"{words!r} not shown; the page says:\n{page.inner_text('body')[-3000:]}") from None


@pytest.mark.slow
def test_both_tiers_live_a_load_from_the_host_tier_in_grid_table_and_misses(engine, start_app):
    from playwright.sync_api import sync_playwright

    c = Client(engine.url)
    url, _ = start_app(["--engine", engine.url])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, url, errors, DEVICE, height=1600, timeout_ms=120_000)
        page.wait_for_function(f"window.__kvscope_grid.tier && window.__kvscope_grid.tier.blocks === {TIER}",
                               timeout=60_000)
        assert page.evaluate("window.__kvscope_grid.tier.held") == 0
        said(page, f"Host tier · {TIER} blocks · 0 hold full blocks")

        for i, prompt in enumerate([SYSTEM + "Why is the sky blue?", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14",
                                    "The quick brown fox jumps over the lazy dog. " * 3]):
            c.request(op="submit", prompt=prompt, max_tokens=4, request_id=f"w{i}")
            c.sync(c.finished(f"w{i}"), 120)
        page.wait_for_function("window.__kvscope_grid.tier.held > 8", timeout=60_000)  # stored as they completed

        c.request(op="pause")
        c.request(op="submit", prompt=SYSTEM + "Name a prime.", max_tokens=40, request_id="again")
        c.request(op="step", count=1)  # its admission: the system prompt's blocks loaded from the host tier
        c.until(lambda: any(e.__struct_config__.tag == "offload_load" for e in c.events), 60)
        loaded = [e for e in c.events if e.__struct_config__.tag == "offload_load"]
        assert {e.seq_id for e in loaded} == {"again"}

        # the device block a load filled is outlined as loaded; the tier's hover says what a block holds
        page.wait_for_function("document.body.innerText.includes('loaded from the host tier')", timeout=60_000)
        tier = page.locator("canvas.tier")
        tier.scroll_into_view_if_needed()
        box = tier.bounding_box()
        page.mouse.move(box["x"] + 3, box["y"] + 3)
        said(page, "Host tier block T0")
        said(page, "a prefix lookup can load back")

        # the request's table marks the blocks that came from the host tier
        chips = page.locator('[title*="loaded from the host tier"]')
        chips.first.wait_for(timeout=60_000)
        assert chips.count() >= len(loaded) or "–" in chips.first.inner_text()

        # the header's card: what the tier holds, and what its loads saved computing again
        said(page, f"{len(loaded)} block{'s' * (len(loaded) != 1)} loaded back instead of computed again "
                   f"({len(loaded) * 4} tokens")

        # why not more: the reason, and what it cost
        page.get_by_role("button", name="Why not more?").click()
        said(page, "hit in the host tier")
        said(page, f"{len(loaded) * 4:,} tokens hit in the host tier")
        SHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOT), full_page=True)
        assert not errors, errors
        browser.close()
    c.request(op="resume")
    c.close()
