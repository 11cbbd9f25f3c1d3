"""The routing lesson (app/lessons/fleet/routing.toml) on the fleet page under AppTest: Start
on an empty fleet starts two real KVScope engines (SmolLM2, their own processes), Next runs each
stop, and what each caption says is checked against the engines themselves: their own snapshots
(the blocks they cache, by their own hashes) and the events an observer of each engine saw (the
requests each got, their prefix hits), not against the dashboard's fleet index."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from websockets.exceptions import InvalidStatus

from app.fleet import load as fleet_load
from app.link.client import EngineClient
from app.lessons.fleet_lesson import all_fleet_lessons, caption, stop_launched
from kvscope_contract import protocol as p
from tests.apptest import lesson_button
from tests.protocol_client import Client
from tests.waiting import wait
from tests.synthetic import synthetic_server

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
LESSONS = {lesson.key: lesson for lesson in all_fleet_lessons()}


def num(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass
class Engine:
    """One engine as the test sees it: its own snapshot now, and every event an observer saw."""
    name: str
    url: str
    observer: EngineClient
    token: str | None = None

    def snapshot(self):
        c = Client(self.url, token=self.token)
        try:
            return c.state, c.hello
        finally:
            c.ws.close()

    def hashes(self) -> Counter:
        st, _ = self.snapshot()
        return Counter(st.hash_of(b) for b in range(st.config.num_device_blocks) if st.has_hash[b])

    def events(self) -> list:
        with self.observer.lock:
            return list(self.observer.history.events)

    def requests(self, prefix: str) -> list[p.RequestAdded]:
        return [e for e in self.events() if isinstance(e, p.RequestAdded) and e.request_id.startswith(prefix)]

    def hits(self, seq_id: str) -> int:
        return sum(1 for e in self.events() if isinstance(e, p.PrefixHit) and e.seq_id == seq_id)

    def chain(self, seq_id: str) -> list[str]:
        """The hashes of the blocks `seq_id` registered, first block first."""
        return [e.hash for e in self.events() if isinstance(e, p.Cached) and e.seq_id == seq_id]


@dataclass
class AtStop:
    words: dict[str, str]
    engines: list[Engine]
    run: object  # the FleetLessonRun

    def fleet_hashes(self) -> tuple[Counter, list[Counter]]:
        each = [e.hashes() for e in self.engines]
        return sum(each, Counter()), each


def empty(at: AtStop) -> None:
    """Both engines' own snapshots: no hashed block, nothing running; the pool the caption names."""
    total, each = at.fleet_hashes()
    assert not total and num(at.words["physical"]) == 0 and num(at.words["duplicated"]) == 0
    for e in at.engines:
        st, _ = e.snapshot()
        assert not st.seqs and st.counts().used == 0
        assert num(at.words["blocks"]) == st.config.num_device_blocks and num(at.words["bs"]) == st.config.block_size
        assert st.config.enable_prefix_caching and at.words["caching"] == "prefix caching on"


def duplicates(at: AtStop) -> int:
    """The duplicated blocks and MiB the caption says equal the engines' own snapshots' (KVScope's
    block hash is the same in every process: equal hashes, equal content)."""
    total, each = at.fleet_hashes()
    dup = sum(n - 1 for n in total.values())
    bpb = at.engines[0].snapshot()[0].config.bytes_per_block
    assert num(at.words["duplicated"]) == dup and num(at.words["physical"]) == sum(total.values())
    assert at.words["dup_mib"] == f"{dup * bpb / 2**20:,.2f}"
    assert num(at.words["on_both"]) == sum(1 for h in total if all(c[h] for c in each))
    return dup


def sent(at: AtStop, policy: str) -> dict[str, list]:
    """The workload reached the engines the policy names, each its share, and every request finished."""
    run = at.run.phases[-1].plan[0][1].request_id.split("-")[0]  # the run's name; the plan made again here
    plan = fleet_load.assign(fleet_load.workload(12, 3, run), [e.name for e in at.engines], policy)
    got = {e.name: e.requests(run + "-") for e in at.engines}
    for e in at.engines:
        assert [r.request_id for r in got[e.name]] == [r.request_id for n, r in plan if n == e.name]
        assert f"{e.name}: {len(got[e.name])}" in at.words["per_engine"]
        assert not e.snapshot()[0].seqs
    assert at.words["requests"] == "12" and at.words["systems"] == "3"
    return got


def systems(got: dict[str, list]) -> dict[str, str]:
    """request id -> its system prompt, as the workload of that run makes it."""
    run = next(r for reqs in got.values() for r in reqs).request_id.split("-")[0]
    return {r.request_id: r.system for r in fleet_load.workload(12, 3, run)}


def hit_claims(at: AtStop, got: dict[str, list]) -> dict[str, int]:
    """A request hit exactly when an earlier request of its system prompt ran on its engine; the hit
    tokens each engine's rate quotes are its requests' prefix hits (returned, by engine)."""
    system, out = systems(got), {}
    for e in at.engines:
        seen, hit_tokens = set(), 0
        for req in got[e.name]:
            n = e.hits(req.seq_id)
            assert (n > 0) == (system[req.request_id] in seen), (e.name, req.request_id, n)
            seen.add(system[req.request_id])
            hit_tokens += n * 16
        assert re.search(rf"{e.name} \d+% \({hit_tokens:,} of [\d,]+ tokens\)",
                         at.words["hit_rates"]), at.words["hit_rates"]
        out[e.name] = hit_tokens
    return out


def rr(at: AtStop) -> None:
    """Round-robin: every system prompt's first block on both engines; duplicates > 0; hits as claimed."""
    got = sent(at, "round-robin")
    assert duplicates(at) > 0
    total, each = at.fleet_hashes()
    system = systems(got)
    for s in fleet_load.SYSTEM_PROMPTS[:3]:
        owner, first = next((e, r) for e in at.engines for r in got[e.name] if system[r.request_id] == s)
        head = owner.chain(first.seq_id)[0]  # the system prompt's first block, by the engine's hash
        assert all(c[head] for c in each), s  # on both engines
        assert s.split(".")[0] in at.words["dup_names"]
    hit_claims(at, got)


def affinity(at: AtStop) -> None:
    """Affinity: no duplicates, each system prompt on one engine; hit rates higher than round-robin's."""
    got = sent(at, "affinity")
    assert duplicates(at) == 0 and at.words["duplicated"] == "0"
    this_run = hit_claims(at, got)
    # what a card's hit rate counts, as the caption says: each engine's own counters since the reset
    # the lesson's clear made (a client attached before it counts from there too)
    only_this_run = "count this run's requests only" in at.words["cards_count"]
    for e in at.engines:
        tl = e.observer.view().mirror.tally
        assert (tl.hit_tokens == this_run[e.name]) == only_this_run, (e.name, tl.since, at.words["cards_count"])
    rates = {k: int(re.match(r"(\d+)%", v["hit_rate"]).group(1)) for k, v in at.run.records.items()}
    assert rates["affinity"] > rates["round-robin"]
    assert "| round-robin |" in at.words["records"] and "| affinity |" in at.words["records"]


def probe(at: AtStop) -> None:
    """The router's score per engine: the picked engine holds the conversation's chain, the other none
    of it; the picked one is where affinity sent it; sent there it reused what the caption says."""
    pr = at.run.probe
    req, first = pr["request"], pr["first_engine"]
    assert at.words["picked"] == pr["picked"] == first
    owner = next(e for e in at.engines if e.name == first)
    other = next(e for e in at.engines if e.name != first)
    original = next(r for r in owner.requests(req.request_id) if r.request_id == req.request_id)
    chain = owner.chain(original.seq_id)
    assert not set(chain) & set(other.hashes())
    again = next(r for r in owner.requests(req.request_id + "-again"))
    reused = owner.hits(again.seq_id) * 16
    assert num(at.words["reused"]) == reused == (original.prompt_tokens - 1) // 16 * 16 > 0
    full = len(original.prompt_token_ids) // 16
    assert f"{first} {full * 16} tokens ({full} blocks)" in at.words["scores"]
    assert f"{other.name} 0 tokens (0 blocks)" in at.words["scores"]
    assert num(at.words["probe_tokens"]) == original.prompt_tokens


CLAIMS = {("routing", 0): empty, ("routing", 1): rr, ("routing", 2): empty, ("routing", 3): affinity,
          ("routing", 4): probe}


def routing_goal(lesson, at: AtStop) -> None:
    """Two engines, one chat workload with three shared system prompts; round-robin duplicates them,
    affinity leaves none and more of each prompt is found; a prefix-aware router scores a prompt."""
    goal = " ".join(lesson.goal.split())
    assert "Two engines, one chat workload with three shared system prompts" in goal
    sends = [st for st in lesson.stops if st.do == "send"]
    assert [st.policy for st in sends] == ["round-robin", "affinity"] and all(st.systems == 3 for st in sends)
    assert len(at.engines) == 2 and at.run.probe is not None
    r = at.run.records
    assert num(r["round-robin"]["duplicated"]) > 0 == num(r["affinity"]["duplicated"])
    hits = {k: int(re.match(r"(\d+)%", v["hit_rate"]).group(1)) for k, v in r.items()}
    assert hits["affinity"] > hits["round-robin"]


GOALS = {"routing": routing_goal}


def test_every_stop_of_the_fleet_lessons_has_its_claims_checked():
    assert set(CLAIMS) == {(key, i) for key, lesson in LESSONS.items() for i in range(len(lesson.stops))}
    assert set(GOALS) == set(LESSONS)  # and every goal line


def card(at: AppTest) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_the_routing_lesson_on_two_engines_it_starts(monkeypatch):
    monkeypatch.setenv("KVSCOPE_FLEET", "")
    monkeypatch.delenv("KVSCOPE_MODEL", raising=False)  # the real SmolLM2: two engines load in ~10 s
    at = AppTest.from_file(MAIN, default_timeout=60)
    at.run()
    assert at.title[0].value == "KVScope · Fleet" and not at.exception
    assert any("No engine yet" in i.value for i in at.info)
    lesson = LESSONS["routing"]
    n = len(lesson.stops)
    at.button(key="fleet_lesson_start").click().run()
    engines: list[Engine] = []
    run = at.session_state["fleet_lesson"]
    try:
        for i, stop in enumerate(lesson.stops):
            if i:
                lesson_button(at, "next", "fleet_lesson").click().run()
            wait(lambda: at.run() and (run.pending is None and len(run.reached) == i + 1 or run.errors), 600,
                 f"stop {i + 1}")
            assert not run.errors, run.errors
            at.run()
            if not engines:  # the lesson started its own two engines; observe them from here on
                assert run.engines == ["lesson-a", "lesson-b"]
                for name in run.engines:
                    url, token = run.fleet.engines[name].endpoint.url, run.fleet.engines[name].endpoint.token
                    with pytest.raises(InvalidStatus, match="401"):  # its engines take their own token only
                        Client(url)
                    obs = EngineClient(url, token)
                    engines.append(Engine(name, url, obs, token))
                wait(lambda: all(e.observer.view() is not None for e in engines), 30, "the observers")
                assert not any("No engine yet" in x.value for x in at.info)  # its two engines are the fleet's
            text = card(at)
            assert caption(stop, run.words()) in text and "?" not in caption(stop, run.words())
            CLAIMS["routing", i](AtStop(run.words(), engines, run))
        assert run.done and "End of the lesson" in "\n".join(c.value for c in at.caption)
        GOALS["routing"](lesson, AtStop(run.words(), engines, run))
        # Back shows an earlier stop's words as they were, Next returns without running anything
        lesson_button(at, "back", "fleet_lesson").click().run()
        assert "stop 4 of 5" in card(at) and "reached earlier" in card(at)
        lesson_button(at, "next", "fleet_lesson").click().run()
        assert "stop 5 of 5" in card(at) and len(run.reached) == n
    finally:
        for e in engines:
            e.observer.close()
        stop_launched(run.fleet)
        for name in run.engines:
            run.fleet.remove(name)


def test_the_lessons_list_opens_the_routing_lesson_on_the_fleet_page(at):
    at.segmented_control(key="mode").set_value("Lessons").run()
    at.selectbox(key="lesson_pick").set_value("fleet:routing").run()
    assert "two engines" in "\n".join(c.value for c in at.sidebar.caption)
    at.sidebar.button(key="lesson_fleet_open").click().run()
    assert at.session_state["source"].kind == "fleet" and at.title[0].value == "KVScope · Fleet"
    assert at.button(key="fleet_lesson_start") and LESSONS["routing"].goal in card(at)


@pytest.mark.slow
def test_the_routing_lesson_in_a_browser(tmp_path):
    """`make run ARGS="--fleet"`, then the lesson in Chromium: Start starts two SmolLM2 engines, each
    Next shows its stop's card, and the page's own fleet-wide numbers agree with the captions
    (duplicated blocks after round-robin, none after affinity)."""
    import os
    import signal

    from playwright.sync_api import sync_playwright
    from tools.launch import CHROMIUM, FLAGS, start_streamlit

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    lesson = LESSONS["routing"]
    log = tmp_path / "streamlit.log"
    with log.open("w") as out:
        streamlit, url = start_streamlit(["--fleet"], out=out)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            main = page.get_by_test_id("stMain")
            main.get_by_text("Lesson: Routing across a fleet").click()
            main.get_by_role("button", name="Start the lesson").click()
            card = page.locator(".st-key-fleet_lesson_card")

            def duplicated() -> str:
                return page.get_by_test_id("stMetric").filter(has_text="duplicated blocks").inner_text().split("\n")[-1]

            for i, stop in enumerate(lesson.stops):
                if i:
                    card.get_by_role("button", name="Next").click()
                card.get_by_text(re.compile(rf"stop {i + 1} of {len(lesson.stops)} · {re.escape(stop.title)}$")) \
                    .wait_for(timeout=600_000)  # the stop's own title (while running: what it is doing)
                text = card.inner_text()
                lead = stop.caption.split("**")[1]  # the caption's bold opening
                assert lead in text and "Error" not in text, text
                if stop.do == "send":  # the page's own index, redrawn every 2 s, says what the caption says
                    said = re.search(r"the two hold (\d+) duplicated blocks|"
                                     r"Duplicated blocks between the two: (\d+)", text)
                    assert said, text
                    n = next(g for g in said.groups() if g is not None)
                    page.wait_for_function("(n) => [...document.querySelectorAll('[data-testid=stMetric]')].some("
                                           "m => m.innerText.startsWith('duplicated blocks') && m.innerText.trim()"
                                           ".endsWith('\\n' + n))", arg=n, timeout=30_000)
                    assert (int(n) > 0) == (stop.policy == "round-robin") and duplicated() == n
            for name in ("lesson-a", "lesson-b"):  # the engines it started, live on the page
                page.locator(f'[data-engine="{name}"] .st.live').wait_for(timeout=10_000)
            assert not errors, errors
            browser.close()
    finally:
        streamlit.send_signal(signal.SIGTERM)
        streamlit.wait(timeout=20)
        print(log.read_text()[-3000:])


def test_an_engine_killed_during_the_lesson_is_said_at_once():
    """On a fleet that has two engines already (engine.synthetic: the real engine core, random
    tokens), the lesson uses them; one killed before a stop: the stop ends with the reason within
    seconds instead of waiting out its timeout, and the other engine stays usable."""
    import os
    import signal
    import time

    from app.fleet.engines import Endpoint, Fleet
    from app.lessons.fleet_lesson import FleetLessonRun

    procs = [synthetic_server(), synthetic_server()]
    fleet = Fleet.of([Endpoint("a", procs[0].url), Endpoint("b", procs[1].url)])
    try:
        run = FleetLessonRun(LESSONS["routing"], fleet)
        wait(lambda: all(fleet.engines[n].client.view() is not None for n in "ab"), 30, "both engines")
        run.next()
        run.wait()
        assert not run.errors and run.engines == ["a", "b"] and run.reached[0]["physical"] == "0"
        os.kill(procs[1].pid, signal.SIGKILL)
        wait(lambda: fleet.engines["b"].client.status.state != "connected", 15, "b seen gone")
        t0 = time.monotonic()
        run.next()
        run.wait(60)
        assert run.pending is None and time.monotonic() - t0 < 30
        assert len(run.reached) == 1 and run.errors and "stop 2: b is" in run.errors[0], run.errors
        assert fleet.engines["a"].client.status.state == "connected"
    finally:
        fleet.close()
        for proc in procs:
            proc.stop()
