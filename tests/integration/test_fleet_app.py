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

from app.data.client import EngineClient
from tools.launch import CHROMIUM, FLAGS, start_streamlit
from tests.integration.test_fleet import synthetic
from tests.waiting import wait

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


@pytest.fixture()
def engines(tmp_path):
    procs = [synthetic(), synthetic()]
    path = tmp_path / "fleet.toml"
    path.write_text("".join(f'[[engine]]\nname = "{n}"\nurl = "{p.url}"\n' for n, p in zip(("pod-a", "pod-b"), procs)))
    yield procs, path
    for proc in procs:
        proc.stop()


def card_of(at: AppTest, name: str) -> str:
    return next(h.value for h in at.html if f'data-engine="{name}"' in h.value)


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
    wait(lambda: at.run() and "cached contents" in [m.label for m in at.metric]
         and int(next(m.value for m in at.metric if m.label == "cached contents").replace(",", "")) > 0,
         60, "the fleet index fills")

    # add an engine while running (a dead address: marked down, the others unaffected), then remove it
    at.sidebar.text_input(key="fleet_add_name").set_value("nowhere")
    at.sidebar.text_input(key="fleet_add_url").set_value("ws://127.0.0.1:9")
    at.sidebar.button[[b.label for b in at.sidebar.button].index("Add engine")].click().run()
    wait(lambda: at.run() and 'class="st down"' in card_of(at, "nowhere"), 30, "the new engine marked down")
    assert 'class="st live"' in card_of(at, "pod-a")
    at.sidebar.selectbox(key="fleet_remove_pick").set_value("nowhere")
    at.sidebar.button(key="fleet_remove").click().run()
    assert not any('data-engine="nowhere"' in h.value for h in at.html)

    # Open: the single-engine views of that engine; Back: the fleet again
    at.button(key="open_pod-b").click().run()
    assert at.session_state["source"].kind == "attach" and at.session_state["source"].url == procs[1].url
    wait(lambda: at.run() and not at.exception and any("Block tables" in t.label for t in at.tabs), 60, "pod-b's views")
    at.sidebar.button(key="fleet_back_btn").click().run()
    assert at.title[0].value == "KVScope · Fleet"
    for o in observers:
        o.close()


@pytest.mark.slow
def test_the_fleet_page_in_a_browser_over_several_redraws(engines, tmp_path):
    from playwright.sync_api import sync_playwright

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    procs, path = engines
    log = tmp_path / "streamlit.log"
    with log.open("w") as out:
        streamlit, url = start_streamlit(["--fleet", str(path)], out=out)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            card = {n: page.locator(f'[data-engine="{n}"]') for n in ("pod-a", "pod-b")}
            for n in card:
                card[n].locator(".st.live").wait_for(timeout=120_000)

            def cached(name: str) -> int:
                return int(re.search(r"cached\s*([\d,]+)", card[name].inner_text()).group(1).replace(",", ""))

            # the load generator: both cards' numbers move without a reload (the cards redraw on their own)
            sidebar = page.get_by_test_id("stSidebar")
            sidebar.get_by_role("button", name="Send").click()
            page.wait_for_function("[...document.querySelectorAll('[data-engine]')].every(e => "
                                   "/cached\\s*[1-9]/.test(e.innerText))", timeout=60_000)
            # kill one engine: its card says down within seconds, the other stays live and keeps redrawing
            os.kill(procs[0].pid, signal.SIGKILL)
            card["pod-a"].locator(".st.down").wait_for(timeout=20_000)
            assert card["pod-a"].locator(".alarm").inner_text().strip().endswith("down")
            before = cached("pod-b")
            sidebar.get_by_role("button", name="Send").click()
            page.wait_for_function("(n) => { const e = document.querySelector('[data-engine=\"pod-b\"]');"
                                   " return e && +(/cached\\s*([\\d,]+)/.exec(e.innerText)[1].replace(/,/g, '')) > n; }",
                                   arg=before, timeout=60_000)
            assert card["pod-b"].locator(".st.live").count() == 1
            assert not errors, errors  # the fleet page's own redraws raised nothing
            # Open pod-b: its single-engine views; Back to the fleet. (The pool grid, switched to from
            # another page in the same tab, can raise createImageData errors of its own: not asserted here.)
            page.locator("[data-testid=stVerticalBlock]", has=card["pod-b"]).last \
                .get_by_role("button", name="Open", exact=True).click()
            main = page.get_by_test_id("stMain")
            main.get_by_text("Connected · attached engine", exact=False).wait_for(timeout=120_000)
            assert re.search(r"\b[\d,]+ / 64\b", main.inner_text()) and procs[1].url in main.inner_text()  # pod-b's pool
            page.get_by_role("button", name="Back to the fleet").click()
            card["pod-b"].locator(".st.live").wait_for(timeout=60_000)
            browser.close()
    finally:
        streamlit.send_signal(signal.SIGTERM)
        streamlit.wait(timeout=20)
        print(log.read_text()[-3000:])
