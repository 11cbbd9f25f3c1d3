"""The Lab's Trace workload in a real browser (issue 35): a request trace of the test's own (the
Mooncake format, conversations sharing system prompts and growing turn by turn) swept at three
capacities under LRU and OPT; the chart's points (each point's description, its aria-label in the
SVG) and the table's data (its CSV download) are the numbers `python -m engine.lab trace:... --json`
gives for the same arguments; with a host tier, each point again beside it. A trace with a bad
line shows the lab's error naming the line, and no chart. The lesson on real traffic, from the
Lessons list to its end in the Lab."""
from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys

from kvscope_contract.lab import TRACE_REASONS, decode_sweep
from tests.traces import write_trace
from tests.lab_page import fill, sweep_trace
from tools.launch import CHROMIUM, FLAGS, ROOT, click_until

REQUESTS, CAPACITIES, POLICIES = 200, (60, 120, 240), ("lru", "opt")
CARD_SHOWS = "s => (document.querySelector('.st-key-trace_lesson_card') || {innerText: ''}).innerText.includes(s)"
POINT = re.compile(r"^(\w+) at (\d+) blocks: (\d+) of (\d+) tokens hit, (\d+) evictions$")


def cli_sweep(trace):
    out = subprocess.run([sys.executable, "-m", "engine.lab", f"trace:{trace}", "--policy", ",".join(POLICIES),
                          "--sweep", ",".join(map(str, CAPACITIES)), "--requests", str(REQUESTS),
                          "--model", "smollm2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return decode_sweep(out.stdout)


def test_the_lab_sweeps_a_trace_and_says_a_bad_line(start_app, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    trace, bad = tmp_path / "chats.jsonl", tmp_path / "bad.jsonl"
    write_trace(trace, REQUESTS)
    lines = trace.read_text().splitlines()[:5]
    broken = json.loads(lines[2])
    broken["input_length"] = len(broken["hash_ids"]) * 512 + 1  # one block more than its ids say
    lines[2] = json.dumps(broken)
    bad.write_text("\n".join(lines) + "\n")

    url, _ = start_app(["--replay", str(ROOT / "assets" / "demo_recording.jsonl")])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1400}, accept_downloads=True)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        sweep_trace(page, trace, REQUESTS, CAPACITIES)
        main = page.get_by_test_id("stMain")

        # the chart: a point per policy and capacity, its exact counts in its description
        points = page.locator("[data-testid='stVegaLiteChart'] svg [aria-label*=' tokens hit, ']")
        expect(points).to_have_count(len(POLICIES) * len(CAPACITIES), timeout=120_000)
        drawn = {}
        for label in points.evaluate_all("es => es.map(e => e.getAttribute('aria-label'))"):
            policy, blocks, hit, looked_up, evictions = POINT.match(label).groups()
            drawn[policy, int(blocks)] = (int(hit), int(looked_up), int(evictions))
        expect(main.get_by_text("ceiling", exact=False).first).to_be_visible()

        # the table's data, as its CSV
        with page.expect_download() as download:
            page.get_by_role("button", name="Download CSV").click()
        table = list(csv.DictReader(io.StringIO(download.value.path().read_text())))

        s = cli_sweep(trace)
        assert drawn == {(pt.policy, pt.blocks): (pt.hit_tokens, pt.looked_up_tokens, pt.evictions) for pt in s.points}
        assert [(r["policy"], int(r["blocks"])) for r in table] == [(pt.policy, pt.blocks) for pt in s.points]
        for row, pt in zip(table, s.points):
            assert int(row["tokens"]) == pt.tokens and int(row["bytes"]) == pt.bytes
            assert (int(row["hit_tokens"]), int(row["looked_up_tokens"])) == (pt.hit_tokens, pt.looked_up_tokens)
            assert {r: int(row[f"missed_{r}"]) for r in TRACE_REASONS} == pt.missed
            assert (int(row["evictions"]), int(row["preemptions"]), int(row["rejected"])) == \
                (pt.evictions, pt.preemptions, pt.rejected)
        assert len({pt.hit_tokens for pt in s.points}) > 1, "the capacities and policies should differ"
        shown = main.get_by_text(f"{s.ceiling:.1%}", exact=False).first
        expect(shown).to_be_visible()  # the ceiling the lab computed, in the caption and the rule's label

        # with a host tier: each policy and capacity again, dashed, its host hits in its description
        fill(page, "Host tier (blocks)", "120")
        page.get_by_role("button", name="Run the sweep").click()
        tiered = page.locator("[data-testid='stVegaLiteChart'] svg [aria-label*=' + a host tier of 120: ']")
        expect(tiered).to_have_count(len(POLICIES) * len(CAPACITIES), timeout=120_000)
        expect(points).to_have_count(2 * len(POLICIES) * len(CAPACITIES))
        expect(main.get_by_text("Dashed: the same device pool with a host tier", exact=False)).to_be_visible()

        # a bad line: the lab's message naming it, and nothing of the sweep left drawn
        fill(page, "Trace file", str(bad))
        page.get_by_role("button", name="Run the sweep").click()
        error = page.get_by_test_id("stAlertContentError")
        expect(error).to_contain_text(f"{bad}:3:", timeout=60_000)
        expect(error).to_contain_text("hash_ids")
        expect(page.get_by_test_id("stVegaLiteChart")).to_have_count(0)
        expect(page.get_by_test_id("stDataFrame")).to_have_count(0)
        assert not errors, errors
        browser.close()


def test_the_traffic_lesson_from_the_lessons_list_in_a_browser(start_app):
    """Lessons, lesson 10, Open it in the Lab, Start, Next to its end and Back: each stop's card
    with its caption and its chart, the point it is about marked (its aria-label), the ceiling the
    test computes from the bundled slice itself; on a replay, since the lesson needs no engine."""
    from playwright.sync_api import expect, sync_playwright

    from app.lessons.trace_lesson import all_trace_lessons
    from tests.traces import ceiling_512

    (lesson,) = all_trace_lessons()
    hit, total = ceiling_512(lesson.path, 1000)
    url, _ = start_app(["--replay", str(ROOT / "assets" / "demo_recording.jsonl")])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1400})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        side, main = page.get_by_test_id("stSidebar"), page.get_by_test_id("stMain")
        side.get_by_text("Lessons", exact=True).click(timeout=120_000)
        side.get_by_role("combobox", name="Lesson").click(timeout=60_000)
        page.get_by_role("option").filter(has_text=lesson.title).click()
        expect(side.get_by_text("It runs in the Lab", exact=False)).to_be_visible(timeout=60_000)
        click_until(page, side.get_by_role("button", name="Open it in the Lab"),
                    "() => [...document.querySelectorAll('[data-testid=stMain] button')]"
                    ".some(b => b.innerText.includes('Start the lesson'))", wait_ms=10_000)
        main.get_by_role("button", name="Start the lesson").click(timeout=60_000)
        card = page.locator(".st-key-trace_lesson_card")
        marked = page.locator("[data-testid='stVegaLiteChart'] svg [aria-label^='marked: ']")
        for i, stop in enumerate(lesson.stops):
            expect(card).to_contain_text(f"stop {i + 1} of {len(lesson.stops)} · {stop.title}", timeout=180_000)
            expect(marked).to_have_count(1)
            expect(card).to_contain_text("python -m engine.lab trace:")
            if i == 0:
                expect(card).to_contain_text(f"{hit:,} of them: {hit / total:.1%}")
                assert marked.get_attribute("aria-label").startswith("marked: lru at 100000 blocks, nothing evicted")
            if i + 1 < len(lesson.stops):  # the card is a fragment redrawn while a stop runs: as a user, again
                click_until(page, card.get_by_role("button", name="Next"), CARD_SHOWS, f"stop {i + 2} of")
        expect(card).to_contain_text("End of the lesson")
        assert "with 16,384 host blocks" in marked.get_attribute("aria-label")
        click_until(page, card.get_by_role("button", name="Back"), CARD_SHOWS, "stop 2 of")
        expect(card).to_contain_text(f"stop 2 of 3 · {lesson.stops[1].title}")
        assert not errors, errors
        browser.close()
