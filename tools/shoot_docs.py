"""Take the documentation's screenshots in a real browser: `streamlit run app/main.py` on the
embedded engine, Debian's chromium through playwright.

    python -m tools.shoot_docs [--model smollm2] [--out assets] [--only misses,...]
    python -m tools.shoot_docs --vllm gemma3 --only vllm     # vLLM (make vllm-venv vllm-gemma3)

Writes screenshot.png (the README's: a shared system prompt, then parallel sampling up to its
first copy-on-write), lesson.png (the prefix caching lesson at its prefix hit, with the prefix
tree open), lab.png (the long and short mixed preset at block sizes 4, 16 and 64), misses.png
(the "Why not more?" panel at the prefix caching lesson's last stop, its what-ifs computed),
hybrid.png (Gemma 3 270M in the sliding windows lesson, started with its one click: a prefix hit
per KV-cache group) and, with --vllm, vllm.png (vLLM serving that model with the plugin: the
shared system prompt scenario's tables in each of its six KV-cache groups).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tools.launch import CHROMIUM, FLAGS, ROOT, click_until, open_grid, start_streamlit

TOP = "document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; })"


def start_app(model: str, vllm: str | None = None, blocks: int = 384) -> tuple[subprocess.Popen, str]:
    if vllm:  # vLLM loads for a minute or more before the dashboard's page has a pool
        return start_streamlit(["--vllm", vllm, "--num-blocks", str(blocks)])
    return start_streamlit(["--model", model])


def open_dashboard(pw, url: str, height: int = 1250, timeout_ms: int = 240_000):
    """(browser, page, errors) with the dashboard drawn: its grid has blocks."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
    errors: list[str] = []
    return browser, open_grid(browser, url, errors, height=height, timeout_ms=timeout_ms), errors


def walk_lesson(page, key_title: str, stops: int, timeout_ms: int = 180_000,
                start: str = "Start the lesson") -> None:
    """Lessons mode, pick the lesson, press `start`, then Next until `stops` stops were reached."""
    side = page.get_by_test_id("stSidebar")
    side.get_by_text("Lessons", exact=True).click()
    side.get_by_label("Lesson").click()
    page.get_by_role("option", name=key_title).click()
    side.get_by_role("button", name=start).click()
    reach_stop(page, 1, timeout_ms)
    for n in range(2, stops + 1):
        next_stop(page, n, timeout_ms)


def next_stop(page, n: int, timeout_ms: int = 180_000) -> None:
    """Next, from stop n - 1 of a running lesson, until stop `n` is reached."""
    click_until(page, page.get_by_test_id("stSidebar").get_by_role("button", name="Next"),
                "n => { const t = document.body.innerText; "
                "return t.includes('running until') || t.includes(`stop ${n} of`); }", n)  # taken
    reach_stop(page, n, timeout_ms)


def reach_stop(page, n: int, timeout_ms: int) -> None:
    """Wait until the lesson's card shows stop `n`, its run done."""
    try:
        page.wait_for_function("n => { const t = document.body.innerText; "
                               "return t.includes(`stop ${n} of`) && !t.includes('running until'); }",
                               arg=n, timeout=timeout_ms)
    except Exception as e:
        raise AssertionError(f"stop {n} not reached; the page says: {page.inner_text('body')[:2500]}") from e


def shoot_explore(page, path: Path) -> None:
    """Two scenarios on one paused pool: four requests share a system prompt, four samples of one
    prompt fork; run from key event to key event up to the first copy-on-write, which the page
    then explains with its blocks ringed."""
    side = page.get_by_test_id("stSidebar")
    side.get_by_role("button", name="Pause", exact=True).click()
    side.get_by_role("button", name="Resume", exact=True).wait_for(timeout=30_000)
    side.get_by_role("button", name="Shared system prompt", exact=True).click()
    page.wait_for_function("document.body.innerText.includes('sys1-4')", timeout=60_000)
    side.get_by_text("Start from a clean slate").click()  # keep the first scenario's blocks in view
    side.get_by_role("button", name="Parallel sampling (n=4)", exact=True).click()
    page.wait_for_function("document.body.innerText.includes('par2')", timeout=60_000)
    for _ in range(40):
        side.get_by_role("button", name="Run to the next key event", exact=True).click()
        page.wait_for_timeout(1500)
        page.wait_for_function("!document.body.innerText.includes('running until')", timeout=120_000)
        if page.evaluate("/Copy-on-write\\s+[1-9]/.test(document.body.innerText)"):
            break
    time.sleep(3)
    page.evaluate(TOP)
    page.screenshot(path=str(path))


def walk_hybrid_lesson(page, stops: int) -> None:
    """The sliding windows lesson started with its one click (on an engine without sliding
    windows it starts a Gemma 3 engine of its own, then the lesson on it), up to stop `stops`."""
    walk_lesson(page, "9. Sliding windows and hybrid models", stops, 900_000, start="Start gemma3 and the lesson")


def shoot_hybrid(page, path: Path) -> None:
    """Gemma 3 270M at the sliding windows lesson's fourth stop: B's prefix hit in every KV-cache
    group (the full-attention group from the start, each sliding-window group only its window's
    blocks), the tables' row per kind of group, the header's groups."""
    walk_hybrid_lesson(page, 4)
    page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.groups === 6", timeout=60_000)
    time.sleep(3)
    page.evaluate(TOP)
    page.screenshot(path=str(path))


def shoot_misses(page, path: Path) -> None:
    """The prefix caching lesson run to its last stop, which opens "Why not more?": the panel,
    once the lab's replay of the session has said what would have hit, from the panel picker down."""
    walk_lesson(page, "4. Prefix caching", 5)
    page.wait_for_function("document.body.innerText.includes('tokens with 2× blocks')", timeout=300_000)
    time.sleep(2)
    page.get_by_text("What each reason means").evaluate("e => e.scrollIntoView({block: 'end'})")
    time.sleep(1)
    top = max(0, page.get_by_text("Lifetimes", exact=True).bounding_box()["y"] - 16)  # the panel picker
    end = page.get_by_text("What each reason means").bounding_box()
    bottom = end["y"] + end["height"] + 12
    page.screenshot(path=str(path), clip={"x": 260, "y": top, "width": 1240, "height": bottom - top})


def shoot_vllm(page, path: Path) -> None:
    """vLLM with the plugin: the shared system prompt scenario run to its end, every KV-cache
    group's table shown (a sliding window's passed blocks are the empty chips)."""
    side = page.get_by_test_id("stSidebar")
    side.get_by_role("button", name="Shared system prompt", exact=True).click()
    page.wait_for_function("document.body.innerText.includes('sys1-4')", timeout=120_000)
    page.get_by_text("Every KV-cache group", exact=True).click()
    page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.groups === 6", timeout=60_000)
    time.sleep(8)
    page.evaluate(TOP)
    page.screenshot(path=str(path))


SHOTS = ("screenshot", "lesson", "lab", "misses", "hybrid", "vllm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--vllm", metavar="MODEL", help="the dashboard on vLLM serving MODEL (the vllm shot)")
    ap.add_argument("--out", type=Path, default=ROOT / "assets")
    ap.add_argument("--only", help=f"the shots to take, of {', '.join(SHOTS)} (default: all but vllm; "
                    "with --vllm: vllm)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else {"vllm"} if args.vllm else set(SHOTS) - {"vllm"}
    if bad := only - set(SHOTS):
        ap.error(f"unknown shots {sorted(bad)}")
    if ("vllm" in only or bool(args.vllm)) and only != {"vllm"} or "vllm" in only and not args.vllm:
        ap.error("the vllm shot needs --vllm MODEL, and --vllm takes that shot alone")
    from playwright.sync_api import sync_playwright

    app, url = start_app(args.model, args.vllm)
    try:
        with sync_playwright() as pw:
            if "screenshot" in only:
                browser, page, _ = open_dashboard(pw, url, height=1250)
                shoot_explore(page, args.out / "screenshot.png")
                browser.close()
            if only & {"lesson", "lab"}:
                browser, page, _ = open_dashboard(pw, url, height=1700)
                walk_lesson(page, "4. Prefix caching", 2)
                page.get_by_text("Prefix tree", exact=True).click()
                page.wait_for_selector(".pt", timeout=30_000)
                time.sleep(2)
                page.evaluate(TOP)
                if "lesson" in only:
                    page.screenshot(path=str(args.out / "lesson.png"))
                if "lab" in only:
                    page.get_by_test_id("stSidebar").get_by_text("Lab", exact=True).click()
                    page.get_by_role("button", name="Run the lab").click()
                    page.wait_for_selector("[data-testid='stImage'] img", timeout=120_000)
                    time.sleep(2)
                    page.evaluate(TOP)
                    page.screenshot(path=str(args.out / "lab.png"))
                browser.close()
            if "misses" in only:
                browser, page, _ = open_dashboard(pw, url, height=1700)
                shoot_misses(page, args.out / "misses.png")
                browser.close()
            if "vllm" in only:
                browser, page, _ = open_dashboard(pw, url, height=1400, timeout_ms=900_000)
                shoot_vllm(page, args.out / "vllm.png")
                browser.close()
            if "hybrid" in only:  # last: this session leaves the app's engine for a Gemma 3 one
                browser, page, _ = open_dashboard(pw, url, height=1250)
                shoot_hybrid(page, args.out / "hybrid.png")
                browser.close()
    finally:
        os.killpg(app.pid, signal.SIGTERM)
        app.wait(timeout=30)
    print(f"wrote {', '.join(f'{s}.png' for s in SHOTS if s in only)} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
