"""The fleet page (app/modes/fleet_view.py) under AppTest and in a real browser, over two real KVScope
servers (engine/synthetic.py): the cards and their numbers, the load generator, opening one engine
in the single-engine views and coming back, adding and removing an engine, a killed engine."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.link.client import EngineClient
from tools.launch import CHROMIUM, FLAGS, start_streamlit
from tests.apptest import panels
from tests.waiting import wait
from tests.synthetic import synthetic_server

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


@pytest.fixture()
def engines(tmp_path):
    procs = [synthetic_server(), synthetic_server()]
    path = tmp_path / "fleet.toml"
    path.write_text("".join(f'[[engine]]\nname = "{n}"\nurl = "{p.url}"\n' for n, p in zip(("pod-a", "pod-b"), procs)))
    yield procs, path
    for proc in procs:
        proc.stop()


def card_of(at: AppTest, name: str) -> str:
    """One engine's card out of the page's grid of cards."""
    grid = next(h.value for h in at.html if f'data-engine="{name}"' in h.value)
    return next(c for c in grid.split('<div class="fc')[1:] if f'data-engine="{name}"' in c)


def test_the_fleet_page_cards_load_open_and_back(engines, monkeypatch):
    procs, path = engines
    monkeypatch.setenv("KVSCOPE_FLEET", str(path))
    at = AppTest.from_file(MAIN, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert at.title[0].value == "KVScope · Fleet"

    def live_cards():
        at.run()
        return all('class="st live"' in card_of(at, n) for n in ("pod-a", "pod-b"))
    wait(live_cards, 30, "both cards live")
    assert "<img" in card_of(at, "pod-a")  # the pool's overview

    # the load generator sends the chat workload round-robin: each engine gets half
    observers = [EngineClient(p.url) for p in procs]
    wait(lambda: all(o.view() is not None for o in observers), 20, "observers attached")
    before = [o.view().mirror.tally.requests for o in observers]
    at.sidebar.number_input(key="fleet_n").set_value(4)
    at.sidebar.button(key="fleet_send").click().run()
    assert "sent 4 of 4 requests round-robin to 2 engines" in at.sidebar.caption.values
    wait(lambda: [o.view().mirror.tally.requests - b for o, b in zip(observers, before)] == [2, 2], 30, "2 each")
    # issue 28: the merged panel, seconds behind the cards, said "The prefix cache is empty" beside cards
    # with cached blocks: it agrees with them, or says it is behind
    for _ in range(8):
        at.run()
        cards = sum(int(re.search(r">cached</span><b>([\d,]+)", card_of(at, n)).group(1).replace(",", ""))
                    for n in ("pod-a", "pod-b"))
        merged = next((m.value for m in at.metric if m.label == "physical blocks"), None)
        if merged is not None and int(merged.replace(",", "")) != cards:
            assert any("changed since" in w.value for w in at.warning), (cards, merged)
    wait(lambda: at.run() and "cached contents" in [m.label for m in at.metric]
         and int(next(m.value for m in at.metric if m.label == "cached contents").replace(",", "")) > 0,
         60, "the fleet index fills")
    # a system prompt scored as the load generator's chats run (the template), with what each engine would reuse
    from app.fleet.load import SYSTEM_PROMPTS
    at.text_area(key="fleet_prompt").set_value(SYSTEM_PROMPTS[0]).run()
    table = next(d.value for d in at.dataframe if "would reuse" in d.value.columns)
    assert list(table["engine"]) == ["pod-a", "pod-b"] and (table["cached tokens"] >= table["would reuse"]).all()
    assert (table["cached tokens"] > 0).any()  # the workload's chats cached this system prompt
    # and why not more: every other token of the prompt has a reason (the last block's: partial)
    for _, row in table.iterrows():
        counts = [int(n.replace(",", "")) for n in re.findall(r" (\d[\d,]*)(?= ·|$| \()", row["why not more"])]
        assert "partial block" in row["why not more"] and row["would reuse"] + sum(counts) == row["prompt tokens"], row
    # Clear every prefix cache says what each engine answered
    at.sidebar.button(key="fleet_clear").click().run()
    wait(lambda: at.run() and "Clear every prefix cache: pod-a emptied · pod-b emptied" in at.sidebar.caption.values,
         30, "both engines' answers to the clear")

    # add an engine while running (an address nothing answers: connecting, as a server still loading
    # its model, the others unaffected), then remove it
    at.sidebar.text_input(key="fleet_add_name").set_value("nowhere")
    at.sidebar.text_input(key="fleet_add_url").set_value("ws://127.0.0.1:9")
    at.sidebar.button[[b.label for b in at.sidebar.button].index("Add engine")].click().run()
    wait(lambda: at.run() and 'class="st connecting"' in card_of(at, "nowhere") and "not answering yet"
         in card_of(at, "nowhere"), 30, "the new engine connecting")
    assert 'class="st live"' in card_of(at, "pod-a")
    at.sidebar.selectbox(key="fleet_remove_pick").set_value("nowhere")
    at.sidebar.button(key="fleet_remove").click().run()
    assert not any('data-engine="nowhere"' in h.value for h in at.html)
    assert 'class="st live"' in card_of(at, "pod-a") and 'class="st live"' in card_of(at, "pod-b")

    # Open: the single-engine views of that engine; Back: the fleet again
    at.selectbox(key="fleet_open_pick").set_value("pod-b").run()
    at.button(key="fleet_open").click().run()
    assert at.session_state["source"].kind == "attach" and at.session_state["source"].url == procs[1].url
    wait(lambda: at.run() and not at.exception and "tables" in panels(at), 60, "pod-b's views")
    at.sidebar.button(key="fleet_back_btn").click().run()
    assert at.title[0].value == "KVScope · Fleet"
    for o in observers:
        o.close()


def test_a_down_engines_card_is_last_seen_and_failed_sends_are_said(engines, tmp_path, monkeypatch):
    """A card names its hit rate's definition and its OpenAI URL; one engine stopped while the load
    generator sends to it, then killed: the sidebar counts its unanswered requests as failed, its
    card is greyed as last seen, and the prefix cache's numbers count the other engine alone."""
    procs, path = engines
    path.write_text(path.read_text().replace('name = "pod-b"\n', 'name = "pod-b"\napi = "http://127.0.0.1:9"\n'))
    monkeypatch.setenv("KVSCOPE_FLEET", str(path))
    at = AppTest.from_file(MAIN, default_timeout=60)
    at.run()
    wait(lambda: at.run() and all('class="st live"' in card_of(at, n) for n in ("pod-a", "pod-b")), 30, "both live")
    assert "hit rate, KVScope's" in card_of(at, "pod-a") and "vLLM's" not in card_of(at, "pod-a")
    assert "OpenAI API http://127.0.0.1:9/v1" in card_of(at, "pod-b") and "OpenAI API" not in card_of(at, "pod-a")
    assert any(c.startswith("2 engines · 2 live") for c in at.caption.values)
    at.sidebar.number_input(key="fleet_n").set_value(4)
    at.sidebar.button(key="fleet_send").click().run()
    wait(lambda: at.run() and all(re.search(r"<span[^>]*>cached</span><b>[1-9]", card_of(at, n))
                                  for n in ("pod-a", "pod-b")), 60, "both cards' cached blocks")

    os.kill(procs[0].pid, signal.SIGSTOP)  # pod-a still looks live: the next Send gives it 2 it never answers
    at.sidebar.button(key="fleet_send").click().run()
    assert "sent 4 of 4 requests round-robin to 2 engines" in at.sidebar.caption.values
    os.kill(procs[0].pid, signal.SIGKILL)
    wait(lambda: at.run() and any("pod-a: 2 requests failed since this Send" in c and "no answer" in c
                                  for c in at.sidebar.caption.values), 30, "pod-a's lost requests said")
    wait(lambda: at.run() and 'class="st down"' in card_of(at, "pod-a"), 30, "pod-a down")
    assert card_of(at, "pod-a").startswith(" out gone") and "last seen" in card_of(at, "pod-a")

    def left_out():
        at.run()
        pod_b = int(re.search(r"<span[^>]*>cached</span><b>([\d,]+)", card_of(at, "pod-b")).group(1).replace(",", ""))
        physical = next((m.value for m in at.metric if m.label == "physical blocks"), "")
        return any(c.startswith(":gray[pod-a is down") for c in at.caption.values) and physical == f"{pod_b:,}"
    wait(left_out, 30, "the fleet's numbers without pod-a's last seen cache")


def test_the_lessons_list_opens_the_routing_lesson_on_the_fleet_one_came_from(engines, monkeypatch):
    """From the fleet page, Open an engine, then the Lessons mode's routing lesson: "Open it on the
    fleet page" returns to that fleet (its engines), not to an empty one."""
    procs, path = engines
    monkeypatch.setenv("KVSCOPE_FLEET", str(path))
    at = AppTest.from_file(MAIN, default_timeout=60)
    at.run()
    wait(lambda: at.run() and all('class="st live"' in card_of(at, n) for n in ("pod-a", "pod-b")), 30, "both live")
    at.selectbox(key="fleet_open_pick").set_value("pod-a").run()
    at.button(key="fleet_open").click().run()
    wait(lambda: at.run() and not at.exception and any(c.key == "mode" for c in at.segmented_control), 60,
         "pod-a's views")
    at.segmented_control(key="mode").set_value("Lessons").run()
    at.selectbox(key="lesson_pick").set_value("fleet:routing").run()
    assert "the fleet you came from" in "\n".join(c.value for c in at.sidebar.caption)
    at.sidebar.button(key="lesson_fleet_open").click().run()
    assert at.session_state["source"].kind == "fleet" and at.session_state["source"].path == str(path)
    wait(lambda: at.run() and any(c.startswith("2 engines") for c in at.caption.values), 30, "the fleet's 2 engines")


# a card's numbers as the page shows them: {"used": "12 19%", ..., "state": "live"}, or null
CARD_NUMBERS = """(name) => {
  const e = document.querySelector(`[data-engine="${name}"]`);
  if (!e) return null;
  const out = {state: e.querySelector('.st')?.textContent, alarm: e.querySelector('.alarm')?.textContent || '',
               drawn: +e.dataset.drawn};
  const keys = e.querySelectorAll('.nums span'), values = e.querySelectorAll('.nums b');
  keys.forEach((k, i) => { out[k.textContent] = values[i]?.textContent; });
  return out;
}"""


def age_s(text: str) -> float:
    """A card's "last event" ("3.4 s ago" -> 3.4)."""
    return float(text.split()[0])


def count(text: str) -> int:
    """The leading count of a card's value ("1,234 19%" -> 1234)."""
    return int(text.split()[0].replace(",", ""))


@pytest.mark.slow
def test_the_fleet_page_in_a_browser_over_several_redraws(engines, tmp_path):
    """Every wait is on something the page or the engines show (a card's state, its numbers
    against the engine's own, a number that moves), never on a time: under a loaded machine the
    redraws slow down but the same things happen."""
    from playwright.sync_api import sync_playwright

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    procs, path = engines
    observer = EngineClient(procs[1].url)  # pod-b as the engine itself says: what its card must show
    console: list[str] = []
    log = tmp_path / "streamlit.log"
    with log.open("w") as out:
        streamlit, url = start_streamlit(["--fleet", str(path)], out=out)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            page.set_default_timeout(120_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: console.append(m.text))
            page.goto(url)

            def numbers(name: str) -> dict:
                return page.evaluate(CARD_NUMBERS, name) or {}

            for n in ("pod-a", "pod-b"):
                wait(lambda: numbers(n).get("state") == "live", 180, f"{n}'s card live")
            wait(lambda: observer.view() is not None, 60, "the observer attached")

            # the load generator: both cards' numbers move without a reload (the cards redraw on their own)
            sidebar = page.get_by_test_id("stSidebar")
            sidebar.get_by_role("button", name="Send").click()
            wait(lambda: all(count(numbers(n).get("cached", "0")) > 0 for n in ("pod-a", "pod-b")), 120,
                 "both cards' cached blocks")

            # kill one engine: its card says down, the other stays live and keeps redrawing
            os.kill(procs[0].pid, signal.SIGKILL)
            wait(lambda: numbers("pod-a").get("state") == "down", 60, "pod-a's card down")
            assert numbers("pod-a")["alarm"].strip().endswith("down")
            requests = observer.view().mirror.tally.requests
            sidebar.get_by_role("button", name="Send").click()  # every request to pod-b, the live one

            def idle_with_all_sent():
                m = observer.view().mirror
                return m.tally.requests >= requests + 12 and not m.state.seqs and m.state.counts()
            wait(idle_with_all_sent, 120, "pod-b served the 12 requests")
            truth = observer.view().mirror.state.counts()  # an idle engine: these stay
            wait(lambda: (c := numbers("pod-b")) and c.get("state") == "live" and count(c["used"]) == truth.used
                 and count(c["cached"]) == truth.cached and count(c["free"]) == truth.free, 120,
                 f"pod-b's card showing its engine's pool ({truth})")
            drawn, age = numbers("pod-b")["drawn"], age_s(numbers("pod-b")["last event"])  # idle: the age grows
            wait(lambda: numbers("pod-b").get("drawn", 0) >= drawn + 2, 60, "pod-b's card redrawn twice more")
            assert age_s(numbers("pod-b")["last event"]) > age
            assert numbers("pod-a")["state"] == "down"
            assert not errors, errors  # the fleet page's own redraws raised nothing
            # Open pod-b: its single-engine views; Back to the fleet. (The pool grid, switched to from
            # another page in the same tab, can raise createImageData errors of its own: not asserted here.)
            main = page.get_by_test_id("stMain")
            main.get_by_role("combobox", name="Open an engine").click()
            page.get_by_role("option", name="pod-b", exact=True).click()
            page.locator(".st-key-fleet_open button").click()  # enabled once the choice has rerun the page
            main.get_by_text("Connected · attached engine", exact=False).wait_for(timeout=180_000)
            assert re.search(r"\b[\d,]+ / 64\b",
                             main.inner_text()) and procs[1].url in main.inner_text()  # pod-b's pool
            page.get_by_role("button", name="Back to the fleet").click()
            wait(lambda: numbers("pod-b").get("state") == "live", 120, "the fleet page again")
            for _ in range(2):  # the fleet page's fragments leave the page and come back
                main.get_by_role("combobox", name="Open an engine").click()
                page.get_by_role("option", name="pod-b", exact=True).click()
                page.locator(".st-key-fleet_open button").click()
                main.get_by_text("Connected · attached engine", exact=False).wait_for(timeout=180_000)
                page.get_by_role("button", name="Back to the fleet").click()
                wait(lambda: numbers("pod-b").get("state") == "live", 120, "the fleet page again")
            browser.close()
        # the logs carry no noise: Streamlit's note on a fragment gone from the page, Vega's on an empty layer
        assert "does not exist anymore" not in log.read_text()
        assert not [m for m in console if "Infinite extent" in m], console[-10:]
    finally:
        observer.close()
        streamlit.send_signal(signal.SIGTERM)
        streamlit.wait(timeout=20)
        print(log.read_text()[-3000:])
