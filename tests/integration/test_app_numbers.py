"""The dashboard's numbers under AppTest against a real engine (tiny model): each is the
engine's own, the same at an event however it is reached, and every view of one redraw
agrees with the others (issue 17)."""
from __future__ import annotations

import re
import time

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from tests.waiting import steady, until_elapsed, wait
from app.derived.words import rate
from tests.apptest import (DEFAULT_POOL, MAIN, delta, embedded_tiny_512x8, events, grid_data, html_with, metric,
                          metric_card, panels, rerun_until, show_log, start, submit, travel_line)


def quiet(c) -> int:
    """The last event once no more arrive for half a second (a paused engine's last step)."""
    return steady(lambda: c.history.last_event, 0.5, what="the engine to go quiet")


def rate_at(c, since: int, n: int) -> str:
    """Tokens/s at event n from the raw events: the tokens of the last RATE_STEPS steps after
    `since`, over their `duration_ms`, as the header formats it."""
    from app.history.mirror import RATE_STEPS
    evs = [e for e in c.history.events if since < e.seq <= n]
    steps = [e for e in evs if e.__struct_config__.tag == "step"][-RATE_STEPS:]
    numbers = {e.step for e in steps}
    tokens = sum(len(e.token_ids) for e in evs if e.__struct_config__.tag == "append" and e.step in numbers)
    return rate(1000 * tokens / sum(e.duration_ms for e in steps))


def test_tokens_per_s_comes_from_step_times_and_holds_while_paused(at, observer):
    """Item 5: the engine's own step times; live, after a pause (wall time passing), and
    travelled to, one event shows one rate."""
    start_ev = observer.history.last_event
    submit(at, "Count slowly to one hundred.", prompt_max=48, prompt_ignore_eos=True)
    wait(lambda: len(events(observer, "step", start_ev)) >= 6, 60, "a few decode steps")
    at.button(key="pause").click().run()
    wait(lambda: observer.loop.paused, what="the pause")
    paused = time.monotonic()
    last = quiet(observer)
    live = rerun_until(at, lambda a: (d := grid_data(a)) and d["seq"] == last and metric(a, "Tokens/s"),
                       what="the paused live view")
    assert live != "0.0" and live == rate_at(observer, start_ev, last), live
    until_elapsed(paused, 4)  # wall time passes; the engine does not run
    at.run()
    assert metric(at, "Tokens/s") == live
    mid = events(observer, "step", start_ev)[3].seq + 2  # inside the fifth step
    at.session_state["travel"] = mid
    at.run()
    assert not grid_data(at)["live"] and metric(at, "Tokens/s") == rate_at(observer, start_ev, mid)
    at.session_state["travel"] = last
    at.run()
    assert not grid_data(at)["live"] and metric(at, "Tokens/s") == live


def test_a_lesson_stop_with_decoding_sequences_shows_its_rate(at, observer):
    """Item 5: at a lesson stop (the engine paused there) the rate is the steps', not zero, and
    stays while the class reads the caption."""
    start(at, "02_fragmentation", 1)
    assert at.session_state["lesson"].reached
    shown, stopped = metric(at, "Tokens/s"), time.monotonic()
    assert shown != "0.0"
    until_elapsed(stopped, 3.5)  # the class reads the caption; the engine does not run
    at.run()
    assert metric(at, "Tokens/s") == shown


def test_leaving_a_lesson_says_the_engine_is_on_its_pool_and_restores_the_one_before(at, observer):
    """Item 11: back in Explore after a lesson, the page says the engine is on the lesson's pool
    (paused), and one click restores the pool Explore had, running. Issue 28, item 4: the lesson's
    'Paused at event' banner and the scenario started before it stay behind in the lesson."""
    at.toggle(key="scenario_clean").set_value(False)
    at.button(key="scenario_parallel").click().run()
    assert any(c.value.startswith("**Watch:**") for c in at.sidebar.caption)
    start(at, "01_block_tables", 1)  # its first stop: the engine paused at an alloc
    cfg = observer.view().mirror.config
    assert (cfg.num_device_blocks, cfg.block_size) != (256, 16) and observer.loop.paused
    assert observer.loop.stopped_at is not None
    at.session_state["travel"] = observer.history.last_event - 2  # as Back leaves it
    at.segmented_control(key="mode").set_value("Explore").run()
    assert grid_data(at)["live"]  # Explore starts live
    assert "Paused at event" not in panels(at)["banner"]
    assert not any(c.value.startswith("**Watch:**") for c in at.sidebar.caption)
    note = next(m.value for m in at.sidebar.markdown if "still on the lesson's pool" in m.value)
    assert f"{cfg.num_device_blocks} blocks of {cfg.block_size}" in note and "paused" in note
    assert "256 blocks of 16" in note and "prefix caching on" in note
    at.button(key="restore_pool").click().run()
    wait(lambda: (c := observer.view().mirror.config).num_device_blocks == 256 and c.block_size == 16
         and c.enable_prefix_caching and not observer.loop.paused, what="the pool from before the lesson")
    rerun_until(at, lambda a: not any("still on the lesson's pool" in m.value for m in a.sidebar.markdown),
                what="the note to go once the app's own client has the pool")


def test_run_to_the_next_key_event_names_the_event_shown_and_a_reset_ends_it(at, observer):
    """Item 11: 'Paused at event N' names the event the views show (the end of the key event's
    step); after a reset the explanation goes (its blocks are gone)."""
    at.button(key="pause").click().run()
    at.toggle(key="scenario_clean").set_value(False)
    at.button(key="scenario_parallel").click().run()
    at.multiselect(key="until_kinds").set_value(["fork"])
    at.button(key="run_until").click().run()
    wait(lambda: events(observer, "fork") and observer.loop.paused and not observer.loop.until, what="the fork")
    last = quiet(observer)
    info = rerun_until(at, lambda a: grid_data(a)["seq"] == last and next(
        (b for b in [panels(a)["banner"]] if "Paused at event" in b), None), what="the explanation")
    assert f"Paused at event {grid_data(at)['seq']:,}" in info
    assert f"({observer.loop.stopped_at:,})" in info or grid_data(at)["seq"] == observer.loop.stopped_at
    from kvscope_contract import protocol as p
    observer.wait_reply(observer.send(p.ResetCmd(config=DEFAULT_POOL)))
    wait(lambda: events(observer, "reset", last), what="the reset")
    rerun_until(at, lambda a: grid_data(a)["seq"] > last, what="the reset drawn")
    assert "Paused at event" not in panels(at)["banner"]


def test_the_event_logs_block_filter_is_empty_until_one_is_chosen(at, observer):
    """Item 13: no '-1' in the block filter."""
    show_log(at)
    box = next(n for n in at.number_input if n.label == "Block")
    assert box.value is None
    at.session_state["log_filter"] = ("", 3)
    at.session_state["log_version"] = 1
    at.run()
    assert next(n for n in at.number_input if n.label == "Block").value == 3


def test_the_lab_says_which_memory_a_block_size_keeps(at, observer):
    """Item 13: the Lab's claim names the memory a block size without device blocks keeps (the
    workload's pool), and a preset run at block sizes 4, 16, 64 uses exactly those pools."""
    at.segmented_control(key="mode").set_value("Lab").run()
    text = " ".join(c.value for c in at.caption)
    assert "not the live engine's" in text and "1,024 × 4, 256 × 16, 64 × 64" in text
    at.multiselect(key="lab_bs").set_value([4, 16, 64]).run()
    at.button(key="lab_run").click().run(timeout=300)
    rows = at.session_state["lab_report"].rows
    assert sorted((r.config.pool.num_device_blocks, r.config.pool.block_size) for r in rows) == [
        (64, 64), (256, 16), (1024, 4)]


@pytest.fixture
def busy_app(monkeypatch):
    """The app attached to a busy synthetic pool (the real engine core, random tokens)."""
    from app.link.launcher import ServerProcess
    eng = ServerProcess("engine.synthetic", ["--port", "0", "--num-device-blocks", "65536", "--num-host-blocks", "1024",
                                            "--fill", "0.3", "--warm-steps", "0", "--live", "64", "--max-tokens", "64",
                                            "--step-delay-ms", "10"]).start()
    assert eng.wait_ready(120), "\n".join(eng.tail(30))
    monkeypatch.setenv("KVSCOPE_ENGINE", eng.url)
    st.cache_resource.clear()
    app = AppTest.from_file(MAIN, default_timeout=60)
    rerun_until(app, grid_data, 60, "the busy pool's grid")
    yield app
    st.cache_resource.clear()
    eng.stop()


def test_every_view_of_a_redraw_under_load_shows_one_event(busy_app):
    """Item 7: a busy pool; on each redraw the time-travel line, the grid's header, the pool
    usage metric, the running metric and the paging card describe one event, live and travelled to."""
    at, seen = busy_app, set()
    for i in range(8):
        at.run()
        if i == 6:  # and a travelled-to event, mid-step
            at.session_state["travel"] = grid_data(at)["seq"] - 3
            at.run()
        data = grid_data(at)
        seen.add(data["seq"])
        caption = travel_line(at)
        assert f"event <b>{data['seq']:,}</b>" in caption
        if " · step " in caption:
            assert f" · step {data['step']} · " in caption
        k = data["counts"]
        assert delta(at, "Pool usage") == f"{k['used']:,} / {data['n']:,}"
        running = sum(1 for _, _, _, status in data["seqs"] if status == "running") if "seqs" in data else None
        if running is not None:
            assert metric(at, "Running") == f"{running:,}"
        card = html_with(at, "What paging saves")
        slots = int(re.search(r"Paged, blocks held × \d+: <b>([\d,]+)</b>", card).group(1).replace(",", ""))
        assert slots == k["used"] * data["bs"]
    assert len(seen) >= 3  # the engine ran between the redraws


def test_a_busy_pools_tokens_per_s_fits_its_card(busy_app):
    """Walk of issue 17: on a busy pool (tens of thousands of tokens/s) the rate read "80,13…",
    cut by its card; it is said in thousands, exact in the tooltip."""
    at = busy_app
    shown = rerun_until(at, lambda a: (v := metric(a, "Tokens/s")) != "0.0" and v, 60, "a rate")
    assert re.fullmatch(r"\d{1,3}(\.\d)? k", shown), shown  # the busy pool runs thousands of tokens/s
    exact = metric_card(at, "Tokens/s")["help"]
    assert re.search(r"this event: [\d,]+\.\d \(", exact), exact


def test_the_history_before_a_restart_stays_browsable(monkeypatch):
    """Item 11: kill the embedded engine, restart it; its history up to the kill can still be
    browsed with time travel (as the page promised), and the page goes back to the live engine."""
    import os
    import signal
    at, h, before = embedded_tiny_512x8(monkeypatch)
    old = h.client
    os.kill(h.process.pid, signal.SIGKILL)
    banner = rerun_until(at, lambda a: next((e.value for e in a.error if "died" in e.value), None), what="the death")
    assert "after a restart too" in banner
    at.button(key="restart_dead").click().run()
    rerun_until(at, lambda a: (d := grid_data(a)) and d["connected"] and h.client is not old and d, 90, "the restart")
    at.button(key="browse_before").click().run()
    data = grid_data(at)
    assert data["seq"] == old.bounds()[1] >= before["seq"] and (data["n"], data["bs"]) == (512, 8)
    assert any("history before the restart" in w.value for w in at.warning)
    first, last = old.bounds()
    at.session_state["travel"] = first + (last - first) // 2  # time travel in the old history
    at.run()
    assert grid_data(at)["seq"] == first + (last - first) // 2 and not grid_data(at)["live"]
    caption = panels(at)["travel"]["caption"]  # nothing runs on there (issue 28, item 4)
    assert "keeps running" not in caption and "press <b>Live</b> for its last event" in caption
    at.session_state["travel"] = None
    at.run()
    assert "Before the restart" in panels(at)["travel"]["caption"]
    at.button(key="browse_live").click().run()
    data = rerun_until(at, lambda a: (d := grid_data(a)) and d["connected"] and d, what="the live engine again")
    assert h.client.bounds()[0] <= data["seq"] and not any("history before the restart" in w.value for w in at.warning)
    st.cache_resource.clear()


def test_a_stop_at_a_prefix_hit_names_and_rings_every_block_of_the_admission(at, observer):
    """Issue 26, item 5: 'Run to the next key event' stopped at a shared system prompt's hit named
    and ringed its first block only, while the step held a prefix_hit for each of its blocks."""
    from app.derived.key_events import block_ranges
    at.button(key="pause").click().run()
    at.toggle(key="scenario_clean").set_value(False)
    at.button(key="scenario_shared").click().run()
    at.multiselect(key="until_kinds").set_value(["prefix_hit"])
    at.button(key="run_until").click().run()
    wait(lambda: observer.loop.paused and not observer.loop.until and observer.loop.stopped_at is not None
         and observer.history.last_event >= observer.loop.stopped_at, what="the prefix hit")
    last = quiet(observer)
    stop = observer.history.event(observer.loop.stopped_at)
    step = [e for e in observer.history.events if e.step == stop.step and e.seq <= last]
    blocks = [e.block_id for e in step if e.__struct_config__.tag == "prefix_hit" and e.seq_id == stop.seq_id]
    assert len(blocks) > 1, blocks
    info = rerun_until(at, lambda a: grid_data(a)["seq"] == last and next(
        (b for b in [panels(a)["banner"]] if "Paused at event" in b), None), what="the explanation")
    assert f"{stop.seq_id} reuses {len(blocks)} cached blocks ({block_ranges(blocks)})" in info, info
    assert f"{len(blocks) * observer.view().mirror.config.block_size:,} prompt tokens" in info
    assert sorted(grid_data(at)["highlight"]) == sorted(blocks)


def test_a_second_tab_counts_from_its_own_attach(at, observer):
    """Issue 28, item 4: a tab opened later was told 'Counters since you attached (event N)' with the
    first tab's N and counts: the client is shared, the counters 'since you attached' are each tab's."""
    begin = observer.history.last_event
    submit(at, "The first tab's request", prompt_max=6)
    wait(lambda: events(observer, "finish", begin), what="the first request")
    second = AppTest.from_file(MAIN, default_timeout=30)  # a new tab on the same client (cache kept)
    rerun_until(second, lambda a: grid_data(a), what="the second tab's grid")
    attached = grid_data(second)["seq"]
    assert f"Counters since you attached (event {attached:,})" in panels(second)["metrics"]["since"]
    assert f"(event {attached:,})" not in panels(at)["metrics"]["since"]  # the first tab: since its own
    mid = observer.history.last_event
    submit(at, "A request both tabs see", prompt_max=6)
    wait(lambda: events(observer, "finish", mid), what="the second request")
    last = quiet(observer)
    for tab in (at, second):
        rerun_until(tab, lambda a: grid_data(a)["seq"] == last, what="the last event")
    whole, before = observer.view().mirror.tally, observer.view(attached).mirror.tally
    for tab, looked_up in ((at, whole.looked_up_tokens), (second, whole.looked_up_tokens - before.looked_up_tokens)):
        assert f"/ {looked_up:,}." in metric_card(tab, "Prefix hit rate")["help"]
    assert whole.looked_up_tokens > whole.looked_up_tokens - before.looked_up_tokens > 0
