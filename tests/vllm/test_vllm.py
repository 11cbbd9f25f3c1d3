"""KVScope inside a real vLLM 0.32 (CPU) serving SmolLM2: the plugin's events against vLLM's own
structures and numbers, and the ZMQ KV-event mode fed by the same vLLM. The tests marked
vllm_smoke are what `make test-vllm-smoke` runs on another release (CI: 0.27.1).

One vLLM serves every test here (loading it takes about a minute): a pool of 48 blocks of 32
tokens, small enough that six long prompts preempt one another. `make test-vllm` builds
.venv-vllm and runs this file; without it `make test` skips it and says why.
"""
from __future__ import annotations

import json
import re
import shlex
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest

from kvscope_contract import protocol as p
from kvscope_contract.invariants import check_invariants
from tests.protocol_client import Client
from integrations.vllm import ADMIT_BURST, ADMIT_PER_S
from integrations.vllm.serve import BUNDLED
from tests.vllm.checks import compare_live_snapshot, finishes
from tests.vllm.vllm_server import NO_VLLM, SAME_HASHES, VLLM_PYTHON, VllmServer, vllm_version
from tests.waiting import wait

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM)]

BLOCKS = 48
SYSTEMS = ("You are a terse assistant for a ship's engine room. Report gauges, pressures and "
           "temperatures in one line, with units, and never speculate about causes. " * 3,
           "You are a librarian who answers every question with the title of one book and one "
           "sentence about why it fits, nothing more, no lists and no quotes. " * 3)
QUESTIONS = ("What is boiler pressure?", "Is the coolant warm?", "What about the oil?")
FILLER = ("the pool holds fixed size blocks of keys and values and each sequence maps its logical "
          "blocks through a block table to physical blocks anywhere in the pool").split()


@pytest.fixture(scope="module")
def vllm():
    # --kv-cache-metrics: vLLM's block residency histograms, which the Grafana board reads
    server = VllmServer(BLOCKS, env=SAME_HASHES, args=["--kv-cache-metrics"]).start()
    yield server
    server.stop()


@pytest.fixture
def c(vllm):
    """A client of the plugin mirroring every event with the reducer."""
    client = Client(vllm.ws)
    yield client
    client.close()


def long_prompt(i: int, words: int = 280) -> str:
    return f"Request {i}: " + " ".join(FILLER[j % len(FILLER)] for j in range(words))


@pytest.mark.vllm_smoke
def test_a_mirror_equals_vllms_own_snapshot_mid_run_and_at_the_end(vllm, c):
    assert c.hello["server"] == f"vllm {vllm_version()} + kvscope plugin"
    cfg = c.hello["config"]
    assert (cfg["num_device_blocks"], cfg["block_size"], cfg["reserved_blocks"]) == (BLOCKS, 32, [0])
    assert cfg["preemption_mode"] == "recompute" and cfg["num_host_blocks"] == 0
    assert c.hello["engine"]["num_layers"] == 30 and c.hello["engine"]["num_kv_heads"] == 3
    assert set(c.hello["supports"]) >= {"submit", "abort"} and "step" not in c.hello["supports"]
    snapshots = c.snapshots
    ack = c.request(op="submit", messages=[{"role": "system", "content": SYSTEMS[0]},
                                           {"role": "user", "content": QUESTIONS[0]}],
                    max_tokens=40, ignore_eos=True, request_id="mid")
    assert ack["type"] == "ack" and ack["request_id"] == "mid" and len(ack["seq_ids"]) == 1
    ack = c.request(op="submit", prompt="Once upon a time, a dragon", n=3, temperature=0.8, seed=7,
                    max_tokens=30, ignore_eos=True)
    assert ack["type"] == "ack" and len(ack["seq_ids"]) == 3
    c.until(lambda: c.kinds["append"] >= 20)
    assert c.state.seqs, "the requests are still running"
    asked = compare_live_snapshot(c)
    finishes(c, 4)
    check_invariants(c.state)
    asked += compare_live_snapshot(c)
    assert not c.state.seqs and c.snapshots == snapshots + asked, "no snapshot was pushed: no divergence"
    assert c.state.ref_counts[0] == 0 and c.state.hash_of(0) is None  # the null block, reserved
    counts = c.state.counts()
    assert counts.free + counts.cached == BLOCKS - 1
    assert not [r for r in c.replies if r["type"] == "error"]


@pytest.mark.vllm_smoke
def test_b_prefix_hit_tokens_per_request_equal_vllms_cached_tokens(vllm, c):
    cached: dict[str, int] = {}
    for k, system in enumerate(SYSTEMS):
        for i, q in enumerate(QUESTIONS):
            rid = f"sys{k}-{i}"
            out = vllm.post("/v1/chat/completions", {
                "model": c.hello["engine"]["model"], "request_id": rid, "max_tokens": 8,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
            cached[rid] = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    c.until(lambda: sum(1 for s in c.state.seqs) == 0 and c.kinds["finish"] >= 6)
    hits: Counter = Counter()
    added: dict[str, str] = {}
    for ev in c.events:
        if isinstance(ev, p.RequestAdded):
            added[ev.seq_id] = ev.request_id
        elif isinstance(ev, p.PrefixHit):
            hits[added[ev.seq_id]] += 32
    assert {rid: hits[rid] for rid in cached} == cached
    assert all(cached[f"sys{k}-{i}"] > 0 for k in range(2) for i in (1, 2)), cached


@pytest.mark.vllm_smoke
def test_c_a_small_pool_preempts_readmits_and_finishes_every_request_once(vllm, c):
    preempted_before = vllm.metric("vllm:num_preemptions_total")
    rids = [c.request(op="submit", prompt=long_prompt(i), max_tokens=150, ignore_eos=True,
                      request_id=f"load{i}")["seq_ids"][0] for i in range(6)]
    c.until(lambda: c.kinds["preempt"] >= 1, timeout=300)
    assert c.request(op="abort", request_id="load5")["type"] == "ack"
    finishes(c, 6, timeout=600)
    check_invariants(c.state)
    done = Counter(e.seq_id for e in c.events if isinstance(e, p.Finish))
    reasons = {e.seq_id: e.reason for e in c.events if isinstance(e, p.Finish)}
    assert done == Counter(rids), "each request finishes exactly once"
    assert reasons[rids[5]] == "abort" and all(reasons[r] == "length" for r in rids[:5])
    preempted = [e.seq_id for e in c.events if isinstance(e, p.Preempt)]
    readmitted = {e.seq_id for e in c.events if isinstance(e, p.StatusChange) and e.status == "running"
                  and any(pe.seq_id == e.seq_id and pe.seq < e.seq for pe in c.events if isinstance(pe, p.Preempt))}
    assert preempted and readmitted >= set(preempted) - {rids[5]}
    assert len(preempted) == vllm.metric("vllm:num_preemptions_total") - preempted_before
    outputs = {e.seq_id: 0 for e in c.events if isinstance(e, p.RequestAdded)}
    for e in c.events:
        if isinstance(e, p.Append):
            outputs[e.seq_id] += len(e.token_ids)
    assert all(outputs[r] == 150 for r in rids[:5])
    compare_live_snapshot(c)


def stored_hashes(sub) -> set[str]:
    """The hashes a KV-event subscriber holds cached, on any medium."""
    with sub.lock:  # its thread changes the forests
        return {h for t in sub.state.tiers() for h in sub.state.forest(t)[0].nodes}


@pytest.mark.vllm_smoke
def test_d_the_zmq_mode_shows_the_blocks_vllm_stores(vllm, c):
    from integrations.kv_events.subscriber import KVEventsSubscriber

    live = KVEventsSubscriber(vllm.kv_events.split("?")[0])  # joins now: sees only what follows
    time.sleep(0.5)  # ZMQ's slow joiner: a SUB socket misses what is sent before it has subscribed
    c.request(op="submit", prompt=long_prompt(9, 120), max_tokens=40, ignore_eos=True, request_id="zmq")
    finishes(c, 1)
    late = KVEventsSubscriber(vllm.kv_events)  # with the replay socket: catches up from the start
    try:
        deep = set(c.state.hash_strings(np.flatnonzero(c.state.has_hash)))
        wait(lambda: stored_hashes(late) == deep, 30, "the replayed stream to match the pool")
        with late.lock:
            assert late.state.per_medium() == {"GPU": int(c.state.has_hash.sum())}
            assert late.state.bad_frames == 0 and late.state.unknown_events == 0
            forest = late.state.forest("GPU")[0]
            drawn, todo = [], forest.roots()  # every cached block hangs in the forest once
            while todo:
                drawn.append(todo.pop())
                todo += forest.kids(drawn[-1])
            assert len(drawn) == len(set(n.key for n in drawn)) == len(deep)
            assert all(len(n.tokens) == 32 for n in drawn)
        ours = {e.hash for e in c.events if isinstance(e, p.Cached)}
        assert ours and ours <= stored_hashes(live), "every block the plugin saw cached, the live stream stored"
    finally:
        live.close()
        late.close()


@pytest.mark.parametrize("key", ["shared", "parallel", "overload", "mixed"])
def test_e_the_dashboards_scenario_presets_make_vllm_hit_its_prefix_cache(vllm, c, key):
    """Each preset of the sidebar, as the dashboard sends it (sized from hello's pool), makes
    vLLM hit its prefix cache; the overload preset also makes it preempt. The mixed preset's
    prompts share less than one 32-token block, so its hits come when it runs a second time."""
    from app.derived.scenarios import SCENARIOS

    scenario = next(s for s in SCENARIOS if s.key == key)
    cfg = p.decode_server_message(json.dumps(c.hello)).config
    cmds = [cmd for run in ((1, 2) if key == "mixed" else (1,)) for cmd in scenario.build(cfg, run)]
    assert not any(isinstance(cmd, p.ResetCmd) for cmd in cmds), "vLLM's pool fits the presets as it is"
    seqs = []
    for cmd in cmds:
        ack = c.request(**json.loads(p.encode(cmd)))
        assert ack["type"] == "ack", ack
        seqs += ack["seq_ids"]
    c.until(lambda: all(any(isinstance(e, p.Finish) and e.seq_id == s for e in c.events) for s in seqs), 600)
    mine = set(seqs)
    assert any(isinstance(e, p.PrefixHit) and e.seq_id in mine for e in c.events), f"{key}: no prefix hit"
    if key == "overload":
        assert any(isinstance(e, p.Preempt) and e.seq_id in mine for e in c.events)


def test_f_what_vllm_cannot_do_answers_unsupported_and_bad_prompts_come_back_as_errors(vllm, c):
    for cmd in ({"op": "step"}, {"op": "pause"}, {"op": "pace", "step_delay_ms": 10},
                {"op": "reset", "config": {"num_device_blocks": 64}}):
        reply = c.request(**cmd)
        assert reply["type"] == "error" and reply["code"] == "unsupported" and len(reply["message"]) > 20
    reply = c.request(op="submit", prompt=long_prompt(0, 1600), max_tokens=8)
    assert reply["type"] == "error" and reply["code"] == "too_long" and "vLLM" in reply["message"]
    reply = c.request(op="abort", request_id="never-submitted")
    assert reply["type"] == "error" and reply["code"] == "not_found"
    assert c.request(op="submit", prompt="Hi", max_tokens=2, request_id="twice")["type"] == "ack"
    assert c.request(op="submit", prompt="Hi", max_tokens=2, request_id="twice")["code"] == "duplicate_id"


def test_f2_vllm_serves_every_vllm_metric_the_grafana_board_and_the_alerts_read(vllm):
    """The board's and the alert rules' vllm: names (tests/grafana_board.py's list) on vLLM's own /metrics."""
    import re
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.grafana_board import ALERTS, VLLM_METRICS
    with urllib.request.urlopen(vllm.api + "/metrics", timeout=30) as r:
        served = {s.name for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples}
    assert VLLM_METRICS <= served, VLLM_METRICS - served
    assert set(re.findall(r"vllm:\w+", ALERTS.read_text())) <= served


def test_f3_a_client_reconnecting_in_a_loop_is_let_in_at_the_plugins_pace(vllm):
    """Issue 37: every connection costs vLLM's engine core a handshake, a hello and a snapshot.
    Past a burst of ADMIT_BURST the plugin lets a reconnect loop in at ADMIT_PER_S a second (it
    measured within 5% of vLLM's quiet ITL p99 that way: docs/vllm.md), each with its snapshot."""
    n = ADMIT_BURST + 4
    start = time.monotonic()
    for _ in range(n):
        client = Client(vllm.ws)
        assert client.snapshots == 1
        client.ws.close()
    assert time.monotonic() - start >= 0.99 * (n - ADMIT_BURST) / ADMIT_PER_S


def test_g_the_dashboard_attached_to_vllm_draws_its_pool_with_the_null_block_reserved(vllm, c, dashboard):
    """The grid on vLLM's pool (no host blocks), then frame after frame of vLLM's traffic as the
    browser pulls them (each a delta from the one it holds), and every other view on the way
    (issue 17, item 1: the first delta of a pool without host blocks raised, the page froze)."""
    from tests.apptest import grid_data

    at = dashboard(KVSCOPE_ENGINE=vllm.ws)
    data = wait(lambda: grid_data(at.run()), 60, "the grid")
    assert data["n"] == BLOCKS and data["bs"] == 32 and data["m"] == 0
    assert data["counts"]["free"] + data["counts"]["cached"] == BLOCKS - 1  # block 0 is neither
    c.request(op="submit", prompt=long_prompt(3, 200), max_tokens=60, ignore_eos=True, request_id="seen")
    data = wait(lambda: (d := grid_data(at.run())) and d["counts"]["used"] and d, 120, "used blocks in the grid")
    assert any(s[1].startswith("cmpl-seen-0-") for s in data["seqs"]) and not at.exception  # [key, id, colour, status]
    frames, panels = [data], ["Event log", "Prefix tree", "Lifetimes", "Timeline"]
    for pull in range(1, 9):  # the canvas holds the last frame and asks for the next
        at.session_state["pool_grid"] = {"sync": {"have": frames[-1]["token"], "pull": pull, "style": 1}}
        if pull <= len(panels):
            next(x for x in at.segmented_control if x.label == "History").set_value(panels[pull - 1])
        d = wait(lambda: (d := grid_data(at.run())) and d["seq"] > frames[-1]["seq"] and d, 120,
                 f"frame {pull}: vLLM's next events")
        assert d["kind"] == "delta" and d["base"] == frames[-1]["token"], d
        errors = [e.value for e in at.error] + [str(e.value) for e in at.exception]
        assert not errors, errors
        frames.append(d)
    assert frames[-1]["seq"] > frames[0]["seq"] + 8
    finishes(c, 1)


def test_g2_the_dashboard_names_vllms_openai_server_and_shows_vllms_own_hit_rate(vllm, c, dashboard):
    """Issue 17, items 8 and 12: the header names vLLM's OpenAI server; after the Overload preset
    (its re-admissions after recompute hit the cache, which vLLM's counter leaves out), the
    dashboard's numbers by vLLM's definition equal vLLM's own /metrics counters' deltas."""
    from tests.apptest import metric_card, panels, rerun_until, status_line
    from app.derived.scenarios import SCENARIOS

    at = dashboard(KVSCOPE_ENGINE=vllm.ws)
    rerun_until(at, lambda a: f"OpenAI API <code>{vllm.api}/v1</code>" in status_line(a), 60,
                "the header to name vLLM's OpenAI server")

    def shown() -> tuple[int, int] | None:
        if "metrics" not in panels(at):  # a rerun that drew no grid (the page between two states): not yet
            return None
        cap = metric_card(at, "Prefix hit rate")["note"]
        assert cap.startswith("vLLM's definition")
        hits, queries = cap.split("·")[1].replace("tokens", "").replace(",", "").split("/")
        return int(hits), int(queries)

    finishes(c, 0)
    before = rerun_until(at, lambda a: shown(), 30, "vLLM's hit rate")
    hits0, queries0 = vllm.metric("vllm:prefix_cache_hits_total"), vllm.metric("vllm:prefix_cache_queries_total")
    preempts0 = sum(isinstance(e, p.Preempt) for e in c.events)
    cfg = p.decode_server_message(json.dumps(c.hello)).config
    seqs = [sid for cmd in next(s for s in SCENARIOS if s.key == "overload").build(cfg, 7)
            for sid in c.request(**json.loads(p.encode(cmd)))["seq_ids"]]
    c.until(lambda: all(any(isinstance(e, p.Finish) and e.seq_id == s for e in c.events) for s in seqs), 600)
    assert sum(isinstance(e, p.Preempt) for e in c.events) > preempts0, "the preset preempts"
    hits, queries = (vllm.metric("vllm:prefix_cache_hits_total") - hits0,
                     vllm.metric("vllm:prefix_cache_queries_total") - queries0)
    after = rerun_until(at, lambda a: (n := shown()) != before and n, 60, "the dashboard to count the preset")
    assert (after[0] - before[0], after[1] - before[1]) == (hits, queries)
    ours = metric_card(at, "Prefix hit rate")["delta"]  # every admission: re-admissions too
    assert int(ours.split("/")[0].replace(",", "")) >= after[0] and "first admission" in vllm_help(at)


def test_g3_every_token_vllm_missed_has_a_reason_that_adds_up_to_its_own_counters(vllm, c, dashboard):
    """Issue 26: the reasons of kvscope_contract/misses.py on vLLM's own events (the plugin's):
    shared system prompts and the Overload preset, which preempts. The first admissions' reasons add
    up to vLLM's prefix_cache_queries less its hits (deltas of its /metrics over the run), its
    re-admissions' misses are `recomputed` (outside vLLM's counters), and every eviction before a
    reuse names the allocation that made it; the dashboard's panel shows the same."""
    from kvscope_contract.misses import ExplainedPool
    from tests.apptest import panels, rerun_until
    from app.derived.scenarios import SCENARIOS

    finishes(c, 0)
    mine = Client(vllm.ws)
    start = mine.state.clone()
    hits0, queries0 = vllm.metric("vllm:prefix_cache_hits_total"), vllm.metric("vllm:prefix_cache_queries_total")
    at = dashboard(KVSCOPE_ENGINE=vllm.ws)  # its first run shows "connecting": it counts all its client sees
    rerun_until(at, lambda a: "metrics" in panels(a), 60, "the dashboard's client to connect before the run")
    cfg = p.decode_server_message(json.dumps(mine.hello)).config
    seqs = [mine.request(op="submit", prompt=SYSTEMS[i % 2] + " " + q, max_tokens=8, ignore_eos=True)["seq_ids"][0]
            for i, q in enumerate(QUESTIONS * 2)]
    mine.until(lambda: all(any(isinstance(e, p.Finish) and e.seq_id == s for e in mine.events) for s in seqs), 300)
    seqs = [sid for cmd in next(s for s in SCENARIOS if s.key == "overload").build(cfg, 9)
            for sid in mine.request(**json.loads(p.encode(cmd)))["seq_ids"]]
    mine.until(lambda: all(any(isinstance(e, p.Finish) and e.seq_id == s for e in mine.events) for s in seqs), 600)
    hits, queries = (vllm.metric("vllm:prefix_cache_hits_total") - hits0,
                     vllm.metric("vllm:prefix_cache_queries_total") - queries0)
    pool = ExplainedPool.from_state(start, keep=None)
    for ev in mine.events:
        pool.apply(ev)
    mine.close()
    t = pool.explainer.totals
    assert (t.first_hit, t.first_looked_up) == (hits, queries) and hits > 0
    first = sum(n for a in pool.explainer.admissions if not a.readmission for n in a.by_reason().values())
    assert first == queries - hits and "recomputed" not in {s.reason for a in pool.explainer.admissions
                                                            if not a.readmission for s in a.spans}
    again = [a for a in pool.explainer.admissions if a.readmission]
    assert again and t.by_reason["recomputed"] == sum(a.missed for a in again) > 0
    assert t.by_reason["unknown"] == 0 and t.by_reason["cold"] > 0 and t.by_reason["partial_block"] > 0
    assert all(e.by_seq for a in pool.explainer.admissions for s in a.spans for e in s.evictions)
    # the panel, attached before the run: vLLM's counters as the header shows them, the reasons beside;
    # opened as the hit-rate card's button does (its trigger calls misses.open_panel)
    from app.panels.misses import PANEL
    from tests.apptest import metric_card
    assert metric_card(at, "Prefix hit rate")["button"][0] == PANEL
    at.session_state["panel_shown"] = PANEL
    at.session_state["log_version"] = (at.session_state["log_version"] if "log_version" in at.session_state else 0) + 1
    at.run()
    def caption(a):
        return next((x.value for x in a.caption if x.value.startswith("vLLM's own counters")), "")
    text = rerun_until(at, lambda a: f"of {t.first_looked_up:,}**" in caption(a) and caption(a), 60, "the panel")
    assert f"**{t.first_hit:,} of {t.first_looked_up:,}**" in text
    assert f"whose {t.by_reason['recomputed']:,} missed" in text
    header = metric_card(at, "Prefix hit rate")["note"]
    assert header.startswith("vLLM's definition") and f"{t.first_hit:,} / {t.first_looked_up:,} tokens" in header


def vllm_help(at) -> str:
    from tests.apptest import metric_card
    return metric_card(at, "Prefix hit rate")["noteHelp"]


def test_h_the_dashboards_kv_events_page_shows_vllms_cached_blocks(vllm, c, dashboard):
    c.request(op="submit", messages=[{"role": "system", "content": SYSTEMS[1]},
                                     {"role": "user", "content": QUESTIONS[2]}], max_tokens=4)
    finishes(c, 1)
    at = dashboard(KVSCOPE_KV_EVENTS=vllm.kv_events, KVSCOPE_TOKENIZER=str(BUNDLED))
    cached = c.state.hash_strings(np.flatnonzero(c.state.has_hash))  # vLLM may cache the same content in two blocks
    label = "cached on the device (GPU)"
    wait(lambda: any(m.label == label and m.value == str(len(cached)) for m in at.run().metric), 60,
         "the page to count vLLM's cached blocks")
    forest = next(h.value for h in at.html if 'class="pt"' in h.value)  # the prefix tree's view
    # a chip per content, or a "… N more …" in a chain longer than the view draws (one becomes longer
    # when vLLM evicts a branch beside it; CI drew 45 chips for 46 contents once: 24 of 25 and a gap)
    elided = sum(int(n) for n in re.findall(r"… (\d+) more …", forest))
    assert forest.count('class="id"') + elided == len(set(cached)) and not at.exception
    assert "librarian who answers every question" in forest  # a block's text, on hover


def test_i_make_run_vllm_starts_vllm_shows_its_progress_then_its_pool(dashboard):
    """What `make run-vllm` does: the dashboard starts vLLM from .venv-vllm with the plugin, shows
    vLLM's log while it loads, then draws its pool."""
    from tests.apptest import grid_data

    at = dashboard(KVSCOPE_VLLM="smollm2", KVSCOPE_ENGINE_ARGS="--num-blocks 40")
    assert any("Starting the vLLM (smollm2) with the KVScope plugin" in s.label for s in at.status)
    data = wait(lambda: grid_data(at.run()), 480, "vLLM's pool in the grid")
    assert data["n"] == 40 and data["counts"]["free"] == 39 and not at.exception
    # the OpenAI server it started on a free port, named in the header, answers there (it listens
    # a little after the plugin's WebSocket)
    from tests.apptest import status_line
    api = re.search(r"OpenAI API <code>(http://[^<]+)</code>", status_line(at)).group(1)

    def models() -> list | None:
        try:
            with urllib.request.urlopen(api + "/models", timeout=10) as r:
                return json.loads(r.read())["data"]
        except OSError:
            return None
    assert wait(models, 120, "vLLM's OpenAI server at the header's URL")[0]["id"] == BUNDLED.name


def test_i2_a_vllm_the_plugin_cannot_show_is_said_in_the_dashboard(dashboard, tmp_path):
    """vLLM with a KV connector (it saves and loads blocks outside the pool): the plugin refuses
    it at attach, vLLM serves on, and the dashboard that started it says why instead of waiting."""
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    at = dashboard(KVSCOPE_VLLM="smollm2",
                   KVSCOPE_ENGINE_ARGS=f"--num-blocks 40 -- --kv-transfer-config {shlex.quote(json.dumps(connector))}")
    said = wait(lambda: next((e.value for e in at.run().error if "cannot show this vLLM" in e.value), None), 480,
                "the dashboard to say why it shows no pool")
    assert "KV connector (ExampleConnector)" in said and "vLLM runs on" in said and not at.exception
    assert not at.status, "no longer 'Starting the vLLM ...'"


# ---------------------------------------------------------------------------- a fleet of two vLLMs
@pytest.fixture(scope="module")
def second(vllm):
    server = VllmServer(BLOCKS, env=SAME_HASHES).start()
    yield server
    server.stop()


@pytest.fixture
def fleet(vllm, second):
    from app.fleet.engines import Endpoint, Fleet

    for server in (vllm, second):  # from an empty prefix cache: every block's tokens seen by the fleet
        with urllib.request.urlopen(urllib.request.Request(server.api + "/reset_prefix_cache", b"", method="POST"),
                                    timeout=30) as r:
            assert r.status == 200
    f = Fleet.of([Endpoint("a", vllm.ws, "vllm-plugin", vllm.api), Endpoint("b", second.ws, "vllm-plugin", second.api)])
    wait(lambda: all(r.state == "live" for r in f.rows()), 60, "both vLLMs live in the fleet")
    wait(lambda: not f.index().holders, 30, "empty prefix caches")
    yield f
    f.close()


def chat(server: VllmServer, system: str, question: str, max_tokens: int = 8) -> dict:
    return server.post("/v1/chat/completions", {"model": BUNDLED.name, "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})


def snapshot_hashes(server: VllmServer) -> Counter:
    c = Client(server.ws)
    try:
        return Counter(c.state.hash_strings(np.flatnonzero(c.state.has_hash)))
    finally:
        c.close()


def settled(fleet, servers) -> None:
    """Until the fleet's view of each server's cached blocks equals the server's own snapshot."""
    def same():
        return all(Counter(x.server_hash for x in fleet.engines[n].contents()) == snapshot_hashes(s)
                   for n, s in zip("ab", servers))
    wait(same, 60, "the fleet's cached blocks to equal the servers' snapshots")


def test_j_a_fleet_of_two_vllms_counts_duplicates_as_their_snapshots_and_scores_as_vllm_reuses(vllm, second, fleet):
    from app.fleet.engines import tokenize

    for k, q in enumerate(QUESTIONS):
        chat(vllm, SYSTEMS[0], q)
        chat(second, SYSTEMS[k % 2], q)  # SYSTEMS[0] on both: duplicated
    settled(fleet, (vllm, second))
    ix = fleet.index()
    snaps = [snapshot_hashes(vllm), snapshot_hashes(second)]
    both = snaps[0] + snaps[1]
    dup = sum(n - 1 for n in both.values())
    assert ix.unknown_blocks() == 0 and ix.hash_disagreements() == 0  # content and hashes agree
    assert dup >= 3 and ix.duplicated_blocks() == dup
    bpb = {r.name: r.bytes_per_block for r in fleet.rows()}
    assert bpb["a"] == bpb["b"] > 0 and ix.duplicated_bytes() == dup * bpb["a"]
    forest = ix.forest()  # the merged forest: the union of both caches, each content once
    assert len(forest.nodes) == len(both) and sum(n.copies for n in forest.nodes.values()) == sum(both.values())
    # a prompt scored per engine, then sent to each: the cached-prefix length equals vLLM's cached_tokens
    chat_prefix = SYSTEMS[1] * 2  # a completion prompt that b has seen the start of, a has not
    second.post("/v1/completions", {"model": BUNDLED.name, "prompt": chat_prefix + " First.", "max_tokens": 2})
    vllm.post("/v1/completions", {"model": BUNDLED.name, "prompt": SYSTEMS[0] + " First.", "max_tokens": 2})
    settled(fleet, (vllm, second))
    for prompt, best in ((chat_prefix + " Which book about the sea?", "b"), (SYSTEMS[0] + " Which gauge?", "a")):
        ix = fleet.index()
        scores = {}
        for name in "ab":
            ids = tokenize(fleet.engines[name], prompt)
            scores[name] = next(s for s in ix.score(ids) if s.engine == name)
        assert scores[best].cached_tokens >= 64 and ix.route(tokenize(fleet.engines["a"], prompt)) == best
        for name, server in zip("ab", (vllm, second)):
            out = server.post("/v1/completions", {"model": BUNDLED.name, "prompt": prompt, "max_tokens": 2})
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == scores[name].reusable_tokens, (name, prompt)


def test_k_round_robin_duplicates_more_than_prefix_affinity_on_the_same_workload(vllm, second, fleet):
    from app.fleet import load as fleet_load

    servers = {"a": vllm, "b": second}
    dup = {}
    for policy in ("round-robin", "affinity"):
        for server in servers.values():
            with urllib.request.urlopen(urllib.request.Request(server.api + "/reset_prefix_cache", b"", method="POST"),
                                        timeout=30):
                pass
        wait(lambda: not fleet.index().holders, 30, "empty prefix caches")
        for name, req in fleet_load.assign(fleet_load.workload(6, 3, policy), ["a", "b"], policy):
            chat(servers[name], req.system, req.question)
        settled(fleet, (vllm, second))
        dup[policy] = fleet.index().duplicated_blocks()
    assert dup["round-robin"] > dup["affinity"], dup


# runs before test_l, which kills the second server (a module fixture)
def test_o_the_routing_lesson_runs_on_two_vllms(vllm, second, fleet):
    """The fleet page's routing lesson on two vLLMs with the plugin (as `make run-fleet` starts
    them): round-robin leaves as many duplicated blocks as the servers' own snapshots hold twice,
    affinity none, the hit rate rises, and the conversation the router scores is found cached on
    the engine it picks as far as its score says."""
    from app.lessons.fleet_lesson import FleetLessonRun, all_fleet_lessons

    lesson = next(x for x in all_fleet_lessons() if x.key == "routing")
    run = FleetLessonRun(lesson, fleet)
    for i in range(len(lesson.stops)):
        run.next()
        run.wait()
        assert not run.errors and len(run.reached) == i + 1, run.errors
        words = run.reached[i]
        if lesson.stops[i].do == "send":
            settled(fleet, (vllm, second))
            both = snapshot_hashes(vllm) + snapshot_hashes(second)
            assert int(words["duplicated"]) == sum(n - 1 for n in both.values())
            assert (int(words["duplicated"]) > 0) == (lesson.stops[i].policy == "round-robin")
    assert run.engines == ["a", "b"]
    rates = {k: int(v["hit_rate"].split("%")[0]) for k, v in run.records.items()}
    assert rates["affinity"] > rates["round-robin"] > 0
    pr = run.probe
    score = next(s for s in pr["scores"] if s.engine == pr["picked"])
    assert pr["reused"] == score.reusable_tokens > 0 and pr["picked"] == pr["first_engine"]


def test_l_a_killed_vllm_is_shown_down_within_seconds_and_the_other_stays_live(vllm, second, fleet):
    import os
    import signal

    from tests.processes import children

    # the whole server: vLLM's engine core (where the plugin's WebSocket lives) is a child of its API server
    doomed, todo = [], [second.proc.pid]
    while todo:
        doomed.append(todo.pop())
        todo += children(doomed[-1])
    for pid in doomed:
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    rows = wait(lambda: (r := {x.name: x for x in fleet.rows()})["b"].state == "down" and r, 20, "b marked down")
    assert time.monotonic() - t0 < 20 and rows["a"].state == "live"
    before = rows["a"].cached
    chat(vllm, SYSTEMS[1], "Anything about whales?")
    wait(lambda: {x.name: x for x in fleet.rows()}["a"].cached > before, 30, "a's numbers to move while b is down")


def test_m_find_ranks_reads_vllms_kv_event_sources(vllm):
    """vLLM 0.32's GET /kv_event_sources (a config per data-parallel rank) gives the fleet this
    server's KV-event endpoint, the same the test started it with; a vLLM without that route (0.27.1,
    by its own OpenAPI schema) gives None, which the sidebar's Find ranks says."""
    from app.fleet.engines import kv_event_sources

    with urllib.request.urlopen(vllm.api + "/openapi.json", timeout=30) as r:
        routes = json.load(r)["paths"]
    found = kv_event_sources(vllm.api)
    if tuple(int(x) for x in vllm_version().split(".")[:2]) >= (0, 32):
        assert "/kv_event_sources" in routes
    if "/kv_event_sources" not in routes:
        assert found is None
        return
    assert found is not None and [(e.url, e.kind, e.rank) for e in found] == [(vllm.kv_events, "kv-events", 0)]


def test_n_the_load_generator_sends_to_a_kv_event_stream_through_its_servers_openai_api(vllm):
    """An engine attached only by its ZMQ KV events, with its server's OpenAI URL as `api`: the
    load generator's chats reach vLLM over HTTP (vLLM's own request counter), the stream then holds
    their prompts' blocks by content (the chat prompt as vLLM's /tokenize gives it), "Clear every
    prefix cache" empties it, and a server that does not answer is said on the page, not raised."""
    from app.fleet import load as fleet_load
    from app.fleet.engines import Endpoint, Fleet
    from app.fleet.content import chain_ids

    f = Fleet.of([Endpoint("z", vllm.kv_events, "kv-events", vllm.api),
                  Endpoint("gone", "tcp://127.0.0.1:9", "kv-events", "http://127.0.0.1:9")])
    try:
        z = f.engines["z"]

        def cleared() -> int:  # vLLM's own word that it reset its prefix cache
            return sum("Successfully reset prefix cache" in line for line in list(vllm.lines))
        resets = cleared()
        assert z.takes_prompts() and z.clear_prefix_cache()
        wait(lambda: cleared() > resets or z.load_errors, 30, "vLLM to reset its prefix cache")
        assert not z.load_errors, list(z.load_errors)
        before = vllm.metric("vllm:request_success_total")
        plan = fleet_load.assign(fleet_load.workload(4, 2, "kv"), ["z"], "affinity")
        assert fleet_load.send_all(plan, lambda n, cmd: f.engines[n].submit(cmd), max_tokens=4) == {}
        wait(lambda: vllm.metric("vllm:request_success_total") >= before + 4, 300, "vLLM to answer the 4 chats")
        assert not z.load_errors, list(z.load_errors)
        sent = set()
        for _, req in plan:
            ids = vllm.post("/tokenize", {"model": BUNDLED.name, "messages": [
                {"role": "system", "content": req.system}, {"role": "user", "content": req.question}]})["tokens"]
            want = chain_ids(ids, 32)
            sent |= set(want)
            wait(lambda: set(want) <= {c.cid for c in z.contents()}, 30, f"{req.request_id}'s blocks in the stream")
        assert f.index().duplicated_blocks() == 0 and f.index().unknown_blocks() == 0
        # cleared: vLLM queues the AllBlocksCleared event and publishes it with its next step's
        # events, so the stream says so once the server runs a request again
        resets = cleared()
        assert z.clear_prefix_cache()
        wait(lambda: cleared() > resets or z.load_errors, 30, "vLLM to reset its prefix cache")
        assert not z.load_errors, list(z.load_errors)
        before = vllm.metric("vllm:request_success_total")
        other = fleet_load.ChatRequest(fleet_load.SYSTEM_PROMPTS[3], "Is this loop fine?", "kv-after")
        z.submit(other.command(4))
        wait(lambda: vllm.metric("vllm:request_success_total") > before, 120, "vLLM to answer after the clear")
        ids = vllm.post("/tokenize", {"model": BUNDLED.name, "messages": [
            {"role": "system", "content": other.system}, {"role": "user", "content": other.question}]})["tokens"]
        after = set(chain_ids(ids, 32))
        wait(lambda: after <= (now := {c.cid for c in z.contents()}) and not now & sent, 30,
             "the stream to hold only what was cached after the clear")
        f.engines["gone"].submit(fleet_load.workload(1)[0].command())
        wait(lambda: f.engines["gone"].load_errors, 30, "the dead server's error")
        said = f.engines["gone"].load_errors[0].lower()
        assert "refused" in said or "error" in said
    finally:
        f.close()
