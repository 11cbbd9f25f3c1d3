"""Watching a trace in the pool (issue 35): the Lab's Trace workload sweeps a trace of the test's own,
then plays one capacity under LRU through the real allocator (engine.lab.trace_play behind the real
WebSocket server). Over many frames the grid draws the played pool, live, and the sweep's curve marks
the played point with the hit rate so far, which only grows in tokens looked up; at the end it is the
sweep's point at that capacity, exactly. Time travel moves the mark back to the event travelled to."""
from __future__ import annotations

import re
import time

from engine.lab.trace_sweep import sweep
from tests.traces import write_trace
from tests.lab_page import fill, sweep_trace
from tools.launch import CHROMIUM, FLAGS, ROOT

REQUESTS, CAPACITIES, PLAYED = 100, (60, 120, 240), 120
MARK = re.compile(r"^playing (\w+) at (\d+) blocks: hit rate ([\d.]+) so far, (\d+) of (\d+) tokens, "
                  r"at (live|event [\d,]+) \(event (\d+)\)(.*)$")


def mark(page) -> tuple | None:
    """The marked point's (policy, blocks, hit, looked up, where, event), None while none is drawn."""
    labels = page.locator("[data-testid='stVegaLiteChart'] svg [aria-label^='playing ']").evaluate_all(
        "es => es.map(e => e.getAttribute('aria-label'))")
    if not labels:
        return None
    policy, blocks, _, hit, looked, where, event, gaps = MARK.match(labels[0]).groups()
    assert not gaps, labels[0]  # the dashboard saw every event (the player queues plenty for a lagging one)
    return policy, int(blocks), int(hit), int(looked), where, int(event)


def test_the_lab_plays_a_trace_in_the_pool_with_its_point_on_the_curve(start_app, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    trace = tmp_path / "chats.jsonl"
    write_trace(trace, REQUESTS)
    want = sweep(trace, [PLAYED], ["lru"], requests=REQUESTS).points[0]
    url, _ = start_app(["--replay", str(ROOT / "assets" / "demo_recording.jsonl")])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1400})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        sweep_trace(page, trace, REQUESTS, CAPACITIES)
        points = page.locator("[data-testid='stVegaLiteChart'] svg [aria-label*=' tokens hit, ']")
        expect(points).to_have_count(2 * len(CAPACITIES), timeout=120_000)

        fill(page, "Pool (blocks)", str(PLAYED))
        fill(page, "Step pace (ms)", "10")
        page.get_by_role("button", name="Play in the pool").click()
        page.wait_for_function(f"window.__kvscope_grid && window.__kvscope_grid.n === {PLAYED}", timeout=120_000)

        # many frames while it plays: the grid live and moving, the mark following it
        frames, marks = [], []
        deadline = time.monotonic() + 420  # about 10 s alone; minutes beside other work
        while (m := mark(page)) is None or m[3] < want.looked_up_tokens:
            assert time.monotonic() < deadline, f"the play did not end: {m}, {len(frames)} frames"
            g = page.evaluate("window.__kvscope_grid")
            frames.append((g["seq"], g["used"], g["live"]))
            if m is not None:
                marks.append(m)
            page.wait_for_timeout(300)
        seqs = [f[0] for f in frames if f[2]]
        assert len(set(seqs)) >= 5 and seqs == sorted(seqs), frames  # live frames, in order
        assert any(used > 0 for _, used, _ in frames), frames  # blocks held while requests run
        looked = [m[3] for m in marks]
        assert len(set(looked)) >= 3 and looked == sorted(looked), marks  # the mark moved with the play
        assert all(m[:2] == ("lru", PLAYED) and m[4] == "live" for m in marks)
        assert mark(page)[2:4] == (want.hit_tokens, want.looked_up_tokens)  # the sweep's point, exactly
        assert want.evictions > 0  # a pool small enough to evict: the played point is not the ceiling

        # time travel: the mark goes back with the grid
        track = page.locator(".scrub .track")
        track.evaluate("e => e.scrollIntoView({block: 'center'})")
        tb = track.bounding_box()
        page.mouse.click(tb["x"] + tb["width"] * 0.3, tb["y"] + tb["height"] / 2)
        page.wait_for_function("window.__kvscope_grid.live === false", timeout=30_000)
        at = page.evaluate("window.__kvscope_grid.seq")
        deadline = time.monotonic() + 30
        while (m := mark(page))[4] == "live":
            assert time.monotonic() < deadline, m
            page.wait_for_timeout(300)
        assert m[5] == at and m[3] < want.looked_up_tokens, (m, at)
        page.get_by_role("button", name="Live").click()
        page.wait_for_function("window.__kvscope_grid.live === true", timeout=30_000)
        assert not errors, errors
        browser.close()
