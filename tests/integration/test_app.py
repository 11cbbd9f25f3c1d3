"""The dashboard under AppTest against a real engine server (tiny model, its own process):
every view and control, checked against what the engine did (seen by an independent client).

AppTest runs fragments once per run (their timers never fire), so each test runs the script
again once the engine has done what the test waits for.
"""
from __future__ import annotations

import json

import pytest
import streamlit as st
from streamlit import dataframe_util
from streamlit.testing.v1 import AppTest

from kvscope_contract import protocol as p
from app.link.client import EngineClient
from tests.waiting import wait
from tests.apptest import (MAIN, delta, embedded_tiny_512x8, events, grid_data, html_with, metric, metric_card,
                          panels, press, rerun_until, reset_pool, reset_widget, show_log, status_line, submit,
                          travel_line)


def test_prompt_pause_step_resume_and_every_view(at, observer):
    at.button(key="pause").click().run()
    wait(lambda: observer.view() and at.run() and at.button(key="step").disabled is False, what="pause")
    start = observer.history.last_event
    submit(at, "Hello, paged world. Tell me about blocks.", prompt_max=24)
    added = wait(lambda: events(observer, "request_added", start), what="the request")[0]
    assert not events(observer, "alloc", start)  # paused: admitted only by a step
    at.button(key="step").click().run()
    allocs = wait(lambda: events(observer, "alloc", start), what="a step's allocations")
    rid = added.request_id
    data = rerun_until(at, lambda a: (d := grid_data(a)) and d["counts"]["used"] and d, what="used blocks")
    truth = observer.view().mirror
    assert data["live"] and data["counts"]["used"] == truth.state.counts().used == len(allocs)
    assert data["touched"].get("alloc") == [len(allocs), len(allocs)]  # the step's allocations: events, blocks outlined
    assert metric(at, "Pool usage") == f"{len(allocs) / 256:.0%}"
    tables = html_with(at, 'class="bt"')
    assert rid in tables and "running" in tables and f"{added.prompt_tokens} prompt" in tables
    card = html_with(at, "What paging saves")
    u = truth.usage()
    assert f"{u['reserved_slots']:,}</b> slots" in card and f"{u['paged_slots']:,}</b> slots" in card
    log = show_log(at)
    assert set(log[log["kind"] == "alloc"]["sequence"]) == {rid}
    assert "paused" in status_line(at)
    at.button(key="resume").click().run()
    wait(lambda: any(e.seq_id == rid for e in events(observer, "finish", start)), what="the request to finish")
    rerun_until(at, lambda a: rid in html_with(a, "bt fin"), what="the finished request")
    assert grid_data(at)["counts"]["used"] == 0
    next(c for c in at.segmented_control if c.label == "History").set_value("Timeline").run()
    charts = rerun_until(at, lambda a: a.get("vega_lite_chart"), what="charts")
    blocks = next(d for d in charts[0].proto.datasets if d.name == "blocks")
    rows = dataframe_util.convert_arrow_bytes_to_pandas_df(blocks.data.data)
    assert set(rows["state"]) == {"used", "cached", "free"} and rows["step"].max() == observer.history.points[-1].step


def scenario_metric(c: EngineClient, key: str, since: int) -> str:
    """The header metric each scenario is about, as the events since `since` give it."""
    if key == "shared":  # hit tokens over the tokens looked up at each admission
        bs = c.view().mirror.config.block_size
        with c.lock:
            stream = [e for e in c.history.events if e.seq > since]
        length: dict[str, int] = {}  # tokens each sequence holds (its scenario began after `since`)
        looked_up = 0
        for e in stream:
            match e:
                case p.RequestAdded():
                    length[e.seq_id] = e.prompt_tokens
                case p.Append():
                    length[e.seq_id] += len(e.token_ids)
                case p.StatusChange(status="running"):
                    looked_up += length[e.seq_id]
        hits = bs * sum(isinstance(e, p.PrefixHit) for e in stream)
        assert hits and looked_up
        return f"{hits / looked_up:.0%}"
    if key == "parallel":
        return f"{len(events(c, 'cow', since)):,}"
    if key == "overload":
        return f"{len(events(c, 'swap_out', since))} / {len(events(c, 'swap_in', since))}"
    return f"{sum(s.status == 'running' for s in c.view().mirror.state.seqs.values())}"


@pytest.mark.parametrize("key,kind,steps,metric_label", [
    ("shared", "prefix_hit", 1, "Prefix hit rate"), ("parallel", "cow", 3, "Copy-on-write"),
    ("overload", "swap_out", 400, "Swaps out / in"), ("mixed", "request_added", 1, "Running")])
def test_each_scenario_shows_its_mechanism(at, observer, key, kind, steps, metric_label):
    """Paused, so the mechanism stays on screen: the scenario's requests wait, Step runs them."""
    at.button(key="pause").click().run()
    wait(lambda: at.run().button(key="step").disabled is False, what="pause")
    start = observer.history.last_event
    at.button(key=f"scenario_{key}").click().run()
    at.number_input(key="step_count").set_value(steps).run()
    at.button(key="step").click().run()
    need = 8 if key == "mixed" else 1
    got = wait(lambda: len(evs := events(observer, kind, start)) >= need and evs, 30, f"{kind} events")
    wait(lambda: events(observer, "step", start), what="the step")
    truth = lambda: scenario_metric(observer, key, start)  # the engine may still be stepping
    rerun_until(at, lambda a: metric(a, metric_label) == truth(), 30, f"{metric_label} to show {truth()}")
    assert any("Watch:" in c.value for c in at.sidebar.caption)
    data = grid_data(at)
    if key == "shared":  # four requests, one system prompt: their first blocks are shared ×4
        assert data["counts"]["shared"] >= 5 and len({e.block_id for e in got}) < len(got)
    if key == "parallel":
        assert events(observer, "fork", start) and data["counts"]["shared"] >= 1
    if key == "overload":
        assert events(observer, "preempt", start) and metric(at, "Preemptions") != "0"
    if key == "mixed":
        assert "fewer slots" in html_with(at, "What paging saves")


def test_reset_to_another_block_size(at, observer):
    reset_pool(at, reset_bs=8, reset_dev=96, reset_host=32, reset_mode="recompute", reset_caching=False)
    cfg = wait(lambda: (c := observer.view().mirror.config).block_size == 8 and c, what="the reset")
    assert (cfg.num_device_blocks, cfg.num_host_blocks, cfg.preemption_mode, cfg.enable_prefix_caching) == (
        96, 32, "recompute", False)
    data = rerun_until(at, lambda a: (d := grid_data(a)) and d["bs"] == 8 and d)
    assert (data["n"], data["m"]) == (96, 32)
    # the sidebar draws before the live views, from the state they drew last: a run later
    rerun_until(at, lambda a: any("Pool: 96 blocks × 8 tokens" in c.value for c in a.sidebar.caption),
                what="the sidebar's pool line")
    start = observer.history.last_event
    submit(at, "A prompt on the new pool", prompt_max=12)
    wait(lambda: events(observer, "finish", start), what="a request on the new pool")
    blocks = {e.block_id for e in events(observer, "alloc", start)}
    assert blocks and max(blocks) < 96


ODD_POOL = p.ResetConfig(block_size=16, num_device_blocks=48, num_host_blocks=12, max_num_seqs=6,
                         enable_prefix_caching=True, preemption_mode="swap")


def reset_form_values(at: AppTest) -> tuple:
    """What the sidebar's Reset pool form would apply, as its widgets show it."""
    return tuple(reset_widget(at, k).value for k in ("reset_bs", "reset_dev", "reset_host", "reset_seqs",
                                                      "reset_mode", "reset_caching"))


def test_the_reset_form_shows_the_pool_it_would_reset_in_a_fresh_tab_and_after_another_mode(at, observer):
    """Issue 17, item 2: fresh tabs, and Explore after the Lab or Lessons, showed block size 1,
    1 device block, 0 host blocks, ... (the widgets' minimums) and Reset engine applied them."""
    assert isinstance(observer.wait_reply(observer.send(p.ResetCmd(config=ODD_POOL))), p.Ack)
    wait(lambda: observer.view().mirror.config.num_device_blocks == 48, what="the odd pool")
    pool = (16, 48, 12, 6, "swap", True)
    st.cache_resource.clear()
    fresh = AppTest.from_file(MAIN, default_timeout=30)  # a new tab: a session of its own
    rerun_until(fresh, lambda a: (d := grid_data(a)) and d["n"] == 48, what="the fresh tab's grid")
    assert reset_form_values(fresh) == pool
    for elsewhere in ("Lab", "Lessons"):
        fresh.segmented_control(key="mode").set_value(elsewhere).run()
        fresh.segmented_control(key="mode").set_value("Explore").run()
        assert observer.view().mirror.config.num_device_blocks == 48, f"{elsewhere} left the pool as it was"
        assert reset_form_values(fresh) == pool, f"after {elsewhere}"
    start = observer.history.last_event
    next(b for b in fresh.sidebar.button if b.label == "Reset engine").click()
    fresh.run()
    reset = wait(lambda: events(observer, "reset", start), what="the reset, unchanged")[-1]
    cfg = reset.config
    assert (cfg.block_size, cfg.num_device_blocks, cfg.num_host_blocks, cfg.max_num_seqs, cfg.preemption_mode,
            cfg.enable_prefix_caching) == pool


def test_time_travel_buttons_scrub_every_view(at, observer):
    start = observer.history.last_event
    submit(at, "Travel back in time with me", prompt_max=16)
    wait(lambda: events(observer, "finish", start), what="a finished request")
    at.run()
    last = at.session_state["travel"] if "travel" in at.session_state else None
    assert last is None and grid_data(at)["live"]
    press(at, observer, "prev_step")
    n = at.session_state["travel"]
    assert n is not None and n < observer.history.last_event
    data = grid_data(at)
    truth = observer.history.at(n)
    assert not data["live"] and data["seq"] == n
    assert data["counts"]["used"] == truth.state.counts().used
    assert "Time travel" in travel_line(at)
    # back through the allocation: the views show the request holding blocks again
    alloc = events(observer, "alloc", start)[0]
    at.session_state["travel"] = alloc.seq
    at.run()
    data = grid_data(at)
    used = observer.history.at(alloc.seq).state.counts().used
    assert data["seq"] == alloc.seq and data["counts"]["used"] == used >= 1
    assert alloc.seq_id in html_with(at, 'class="bt"')
    assert show_log(at)["event"].iloc[0] <= alloc.seq  # the log is frozen at that event too
    press(at, observer, "next")
    assert at.session_state["travel"] == alloc.seq + 1
    press(at, observer, "live")
    assert at.session_state["travel"] is None and grid_data(at)["live"]


def test_event_log_filters(at, observer):
    start = observer.history.last_event
    submit(at, "Filter me", prompt_max=8)
    fin = wait(lambda: events(observer, "finish", start), what="a finished request")[0]
    show_log(at)
    at.multiselect(key="log_kinds").set_value(["alloc", "free"])
    next(t for t in at.text_input if t.label == "Sequence or request").set_value(fin.seq_id)
    at.run()
    log = at.dataframe[0].value
    assert set(log["kind"]) == {"alloc", "free"} and set(log["sequence"]) == {fin.seq_id}
    block = int(log["blocks"].iloc[0])
    next(n for n in at.number_input if n.label == "Block").set_value(block)
    at.run()
    assert all(str(block) in b.split() for b in at.dataframe[0].value["blocks"])


def test_the_event_log_downloads_the_history_as_a_perfetto_trace(at, observer):
    from tests.perfetto_trace import decode

    start = observer.history.last_event
    submit(at, "Trace me", prompt_max=8)
    fin = wait(lambda: events(observer, "finish", start), what="a finished request")[0]
    show_log(at)
    at.button(key="perfetto_make").click().run()
    label, data = at.session_state["perfetto_trace"]
    (download,) = [d for d in at.get("download_button") if "Download kvscope.pftrace" in d.proto.label]
    assert label in download.proto.label
    names, _, evs = decode(data)
    assert fin.seq_id in names.values()  # the finished request's track, ended with its reason
    assert any(te.name == f"finished: {fin.reason}" for _, te in evs)


def test_abort_clear_prefix_cache_and_pace(at, observer):
    start = observer.history.last_event
    at.select_slider(key="pace").set_value(50)
    at.run()
    submit(at, "Count to a thousand, slowly.", prompt_max=2000, prompt_ignore_eos=True)
    added = wait(lambda: events(observer, "alloc", start), what="the long request")[0]
    rerun_until(at, lambda a: added.seq_id in (a.selectbox(key="abort_rid").options or []), what="abort choice")
    at.selectbox(key="abort_rid").set_value(added.seq_id).run()
    at.button(key="abort").click().run()
    fin = wait(lambda: events(observer, "finish", start), what="the abort")[0]
    assert fin.reason == "abort"
    cached = wait(lambda: observer.view().mirror.state.counts().cached, what="cached blocks")
    at.button(key="clear_cache").click().run()
    wait(lambda: len(events(observer, "evict", fin.seq)) == cached, what="evictions")
    rerun_until(at, lambda a: grid_data(a)["counts"]["cached"] == 0)


def connection_panel_open(at: AppTest) -> bool:
    return next(e for e in at.sidebar.expander if e.label == "Connection").proto.expanded


def test_bad_input_is_explained_and_loses_nothing(at, observer):
    at.radio(key="src_kind").set_value("attach")
    at.run()
    assert not connection_panel_open(at)  # connected, nothing changed: the panel is closed
    at.text_input(key="src_url").set_value("http://not-a-websocket").run()
    assert connection_panel_open(at)  # a choice being made: a redraw must not close it under the user
    next(b for b in at.sidebar.button if b.label == "Connect").click()
    at.run()
    assert any("ws://" in e.value for e in at.sidebar.error) and connection_panel_open(at)
    assert grid_data(at)  # still drawing the engine it had
    at.number_input(key="prompt_max").set_value(4096)
    submit(at, "x " * 3000)  # can never fit the pool: the engine's error reaches the user
    rerun_until(at, lambda a: any("too_long" in c.value for c in a.sidebar.caption), what="the error")
    assert not exceptions(at)


def exceptions(at: AppTest) -> list:
    return [e.value for e in at.exception]


def test_unreachable_engine_shows_reconnecting(monkeypatch):
    monkeypatch.setenv("KVSCOPE_ENGINE", "ws://127.0.0.1:9/")
    st.cache_resource.clear()
    at = AppTest.from_file(MAIN, default_timeout=30)
    rerun_until(at, lambda a: "Reconnecting" in status_line(a), 10)
    assert any("first snapshot" in i.value for i in at.info) and not exceptions(at)
    st.cache_resource.clear()


def test_replay_of_a_recording(engine, recording, observer, monkeypatch):
    observer.wait_reply(observer.send(p.Submit(prompt="Recorded for the replay", max_tokens=8)))
    wait(lambda: events(observer, "finish"), what="something to record")
    monkeypatch.delenv("KVSCOPE_ENGINE", raising=False)
    monkeypatch.setenv("KVSCOPE_REPLAY", str(recording))
    st.cache_resource.clear()
    at = AppTest.from_file(MAIN, default_timeout=30)
    data = rerun_until(at, lambda a: grid_data(a), 60, "the replay's grid")
    assert "replay" in status_line(at) and data["n"] >= 1
    assert next(b for b in at.sidebar.button if b.label == "Submit").disabled
    from app.ui.connection import hosted
    proc = hosted("engine.serve.replay", (str(recording), "--port", "0", "--loop", "--speed", "1")).process
    st.cache_resource.clear()  # releasing the resource stops the child server
    wait(lambda: proc.state == "exited", 15, "the replay to stop")


def test_embedded_engine_shows_progress_then_the_pool(monkeypatch):
    for var in ("KVSCOPE_ENGINE", "KVSCOPE_REPLAY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVSCOPE_MODEL", "tiny")
    st.cache_resource.clear()
    at = AppTest.from_file(MAIN, default_timeout=30).run()
    status = [s.label for s in at.status]
    assert status and "Starting the embedded engine (tiny)" in status[0] and grid_data(at) is None  # the
    # first run starts the child process, which cannot be serving yet: progress, then the pool
    rerun_until(at, lambda a: grid_data(a), 90, "the embedded engine's grid")
    assert "tiny-llama" in status_line(at)
    from app.ui.connection import hosted
    proc = hosted("engine.serve.server", ("--model", "tiny", "--port", "0")).process
    assert proc.state == "ready" and any("ready: ws://" in line for line in proc.lines)
    st.cache_resource.clear()
    wait(lambda: proc.state == "exited", 15, "the embedded engine to stop")


# ------------------------------------------------------------------ issue 8: the bugs a new user met


def test_shrinking_the_pool_draws_the_new_pool_and_keeps_every_panel(at, observer):
    """Bug 1: 256 x 16, a ~300-word prompt with max tokens 1, then a reset to 12 blocks: the grid
    raised IndexError (the step's events from before the reset named blocks past 12) and the
    panels after it vanished."""
    start = observer.history.last_event
    submit(at, "Tell me about paged attention. " + "block table " * 150, prompt_max=1)
    wait(lambda: events(observer, "finish", start), what="the long prompt to finish")
    rerun_until(at, lambda a: grid_data(a)["counts"]["cached"] > 12, what="more than 12 cached blocks")
    reset_pool(at, reset_dev=12)
    data = rerun_until(at, lambda a: (d := grid_data(a)) and d["n"] == 12 and d, what="the 12-block pool")
    assert not exceptions(at) and not at.error
    assert data["counts"]["free"] == 12 and "reset" in data["touched"] or not data["touched"]
    at.button(key="pause").click().run()  # a sidebar button: every panel is still drawn
    assert grid_data(at)["n"] == 12 and html_with(at, 'class="bt"') and at.segmented_control
    assert not exceptions(at)


def test_a_panel_that_fails_shows_its_error_and_the_others_stay(at, monkeypatch):
    import app.panels.tables
    monkeypatch.setattr(app.panels.tables, "render_finished", lambda *a: 1 / 0)
    at.run()
    assert any("ZeroDivisionError" in e.value for e in at.error)  # said where it happened
    shown = panels(at)
    assert "ZeroDivisionError" in shown["tables"]["error"]  # said where it happened
    assert grid_data(at) and shown["metrics"]["cards"] and shown["card"] and at.segmented_control  # the others


def test_hit_rate_in_the_header_never_passes_100_percent(at, observer):
    """Bug 2 through the page: block size 1, 256 blocks, swap, "Shared system prompt"."""
    reset_pool(at, reset_bs=1, reset_dev=256, reset_mode="swap")
    wait(lambda: observer.view().mirror.config.block_size == 1, what="the reset")
    start = observer.history.last_event
    at.button(key="scenario_shared").click().run()
    wait(lambda: len(events(observer, "finish", start)) == 4, 90, "the four requests")
    truth = observer.view().mirror.tally
    assert truth.hit_tokens <= truth.looked_up_tokens and events(observer, "preempt", start)
    from app.panels.header import _of_tokens
    rerun_until(at, lambda a: delta(a, "Prefix hit rate") == _of_tokens(truth.hit_tokens, truth.looked_up_tokens))
    assert int(metric(at, "Prefix hit rate").rstrip("%")) <= 100
    assert "every admission" in metric_card(at, "Prefix hit rate")["help"]


def test_the_last_error_goes_once_a_command_works(at, observer):
    at.number_input(key="prompt_max").set_value(4096)
    submit(at, "x " * 3000)
    failed = lambda a: next((t.value for t in a.toast if "failed" in t.value), None)
    toast = failed(at) or rerun_until(at, failed, what="the toast")
    assert toast.startswith("**Submit** failed") and "too_long" in toast  # not "Submitted failed"
    rerun_until(at, lambda a: any("Last error" in c.value and "too_long" in c.value for c in a.sidebar.caption))
    at.number_input(key="prompt_max").set_value(4)
    submit(at, "a short one")
    rerun_until(at, lambda a: not any("Last error" in c.value for c in a.sidebar.caption), what="the error to go")


def test_scenario_hints_and_buttons_follow_the_pool(at, observer):
    reset_pool(at, reset_mode="recompute", reset_caching=False)
    wait(lambda: not observer.view().mirror.config.enable_prefix_caching, what="the reset")
    # the sidebar draws the state the live views last drew: the app's own client, a redraw behind
    helps = rerun_until(at, lambda a: (h := {b.key: b.help for b in a.sidebar.button})
                        and "swapped out" not in h["scenario_overload"] and h, what="the hints on the new pool")
    assert "recompute" in helps["scenario_overload"] and "swapped out" not in helps["scenario_overload"]
    assert "off" in helps["scenario_shared"] and "×4" not in helps["scenario_shared"]
    assert at.button(key="clear_cache").disabled
    at.toggle(key="scenario_clean").set_value(False)
    at.button(key="scenario_parallel").click().run()
    assert any(t.value.startswith("Parallel sampling (n=4): par") for t in at.toast)  # names its request


def test_the_views_of_one_redraw_show_one_event_and_the_timeline_rescales(at, observer):
    start = observer.history.last_event
    submit(at, "Count the blocks with me, one by one.", prompt_max=40, prompt_ignore_eos=True)
    wait(lambda: events(observer, "finish", start), what="the request")
    at.session_state["log_filter"] = ("", 200)  # as a click on block 200 of the grid leaves it
    show_log(at)
    assert at.button(key="clear_filter").label == "Filtered to block 200"
    reset_pool(at, reset_dev=12)
    data = rerun_until(at, lambda a: (d := grid_data(a)) and d["n"] == 12 and d, what="the reset")
    used = data["counts"]["used"]
    assert delta(at, "Pool usage") == f"{used:,} / 12"
    assert f"event <b>{data['seq']:,}</b>" in travel_line(at)  # the scrubber's caption
    assert not [b for b in at.button if b.key == "clear_filter"]  # a filter past the pool is dropped
    submit(at, "After the reset", prompt_max=4)
    wait(lambda: events(observer, "step", data["seq"]), what="a step on the small pool")
    next(c for c in at.segmented_control if c.label == "History").set_value("Timeline").run()
    chart = rerun_until(at, lambda a: a.get("vega_lite_chart"), what="the timeline")[0]
    assert json.loads(chart.proto.spec)["layer"][0]["encoding"]["y"]["scale"]["domain"] == [0, 12]


def test_run_to_the_next_key_event_stops_there_and_explains_it(at, observer):
    at.button(key="pause").click().run()
    at.toggle(key="scenario_clean").set_value(False)
    at.button(key="scenario_parallel").click().run()
    at.multiselect(key="until_kinds").set_value(["fork"])
    at.button(key="run_until").click().run()
    forks = wait(lambda: events(observer, "fork"), what="the fork")
    info = rerun_until(at, lambda a: next((b for b in [panels(a).get("banner", "")] if "Paused at event" in b), None),
                       what="the explanation")
    assert "now shared by 4 sequences: the fork of parallel sampling" in info
    assert f"blocks {forks[0].block_ids[0]}" in info and grid_data(at)["highlight"] == forks[0].block_ids
    assert not events(observer, "cow")  # it stopped at the fork, before any copy


def test_clean_slate_starts_the_counters_afresh_and_the_past_stays_reachable(at, observer):
    start = observer.history.last_event
    at.button(key="scenario_shared").click().run()
    wait(lambda: len(events(observer, "finish", start)) == 4, 90, "the scenario")
    rerun_until(at, lambda a: metric(a, "Prefix hit rate") != "0%", what="hits")
    before = observer.history.last_event
    at.button(key="clean_slate").click().run()
    wait(lambda: observer.view().mirror.state.counts().cached == 0, what="the prefix cache to empty")
    rerun_until(at, lambda a: delta(a, "Prefix hit rate") == "0 / 0 tokens", what="fresh counters")
    assert "clean slate" in metric_card(at, "Prefix hit rate")["help"]
    at.session_state["travel"] = before - 1  # the scenario is still there in the past
    at.run()
    assert metric(at, "Prefix hit rate") != "0%"


def test_a_killed_engine_is_said_and_restarts_with_its_pool_only_when_asked(monkeypatch):
    """Bug 4: kill -9 the embedded engine. The page says so (exit, last lines), claims nothing
    live, keeps the history, never restarts on its own; Restart brings back the same pool."""
    import os
    import signal
    at, h, _ = embedded_tiny_512x8(monkeypatch)
    dead = h.process
    os.kill(dead.pid, signal.SIGKILL)
    banner = rerun_until(at, lambda a: next((e.value for e in a.error if "died" in e.value), None), what="the death")
    assert "SIGKILL" in banner and "Died" in status_line(at)
    data = grid_data(at)
    assert data["connected"] is False and data["n"] == 512  # the last state, not "live"
    assert "Live" not in travel_line(at) and "Not connected" in travel_line(at)
    assert dead.wait_handled(30)  # the death was handled where an automatic restart would start
    at.run()
    assert h.process is dead  # nothing restarts it behind the user's back
    at.button(key="restart_dead").click().run()
    assert h.process is not dead and "--pool" in h.process.args
    restarted = h.process
    h.restart(dead)  # the same click again (a second tab, a double click): nothing more starts
    assert h.process is restarted
    data = rerun_until(at, lambda a: (d := grid_data(a)) and d["connected"] and d, 90, "the restarted engine")
    assert (data["n"], data["bs"]) == (512, 8)
    st.cache_resource.clear()


def test_clicking_the_mode_already_selected_keeps_it_selected(at):
    """Issue 28: a second click on the selected mode left no mode highlighted."""
    mode = lambda: at.segmented_control(key="mode")  # noqa: E731
    mode().set_value("Lessons").run()
    mode().set_value(None).run()  # what a click on the selected option sends
    assert mode().value == "Lessons" and not at.exception
    mode().set_value("Explore").run()
    mode().set_value(None).run()
    assert mode().value == "Explore"
