"""The dashboard's state layer on a real engine's events (tiny model, in process): the
mirror's derived numbers, time travel over a bounded history, the event log's filters, the
scenario presets and the command line (the grid's frames: tests/unit/test_grid.py)."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvscope_contract import protocol as p
from engine.config import EngineConfig
from engine.model.engine import LLMEngine
from engine.model.model_loader import load_model
from engine.core.sequence import SamplingParams
from kvscope_contract.state import PoolState
from app.panels import eventlog, grid
from app.history.event_history import EventHistory
from app.history.mirror import Mirror
from kvscope_contract.counters import STREAM_COUNTERS as COUNTERS, StreamCounter
from app.derived.scenarios import SCENARIOS
from app.link.source import Source, from_command_line, python_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recorded():
    """(first snapshot, events) of a real run that shares prefixes, forks, copies on write,
    swaps, recomputes and finishes: a small pool under pressure."""
    eng = LLMEngine(EngineConfig(model="tiny", pool=p.PoolConfig(
        block_size=4, num_device_blocks=40, num_host_blocks=8)), load_model("tiny"))
    first = eng.snapshot()
    shared = "You are a helpful assistant who answers briefly. "
    for i, q in enumerate(["Why is the sky blue?", "What is a cache?", "Name a prime."]):
        eng.add_request(shared + q, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request([17, 42, 99, 7, 1000, 23], SamplingParams(max_tokens=25, n=3, temperature=0.9, seed=1))
    eng.generate([])  # runs what was added to the end
    return first, eng.log.drain(), eng.snapshot()


def kinds(events) -> set[str]:
    return {e.__struct_config__.tag for e in events}


def test_the_recorded_run_shows_every_mechanism(recorded):
    _, events, _ = recorded
    assert {"prefix_hit", "fork", "cow", "preempt", "swap_out", "swap_in", "finish"} <= kinds(events)


def test_mirror_ends_in_the_engines_state_and_counts_each_decision(recorded):
    first, events, last = recorded
    m = Mirror.from_snapshot(first)
    for ev in events:
        m.apply(ev)
    assert m.state.snapshot() == PoolState.from_snapshot(last).snapshot()
    tl, count = m.tally, lambda k: sum(e.__struct_config__.tag == k for e in events)
    assert (tl.cows, tl.forks, tl.swap_outs, tl.swap_ins, tl.preemptions, tl.finished) == (
        count("cow"), count("fork"), count("swap_out"), count("swap_in"), count("preempt"), count("finish"))
    assert tl.hit_tokens == 4 * count("prefix_hit") > 0
    prompts = sum(e.prompt_tokens for e in events if isinstance(e, p.RequestAdded))
    assert tl.hit_tokens < prompts <= tl.looked_up_tokens  # every request was looked up at least once
    assert tl.generated == sum(len(e.token_ids) for e in events if isinstance(e, p.Append))
    assert [f.seq_id for f in m.finished][-3:] == [e.seq_id for e in events if isinstance(e, p.Finish)][-3:]


def test_hit_rate_counts_every_admission_and_never_passes_100_percent(monkeypatch):
    """Issue 8, bug 2: block size 1, 256 blocks, swap mode, "Shared system prompt": the host pool
    fills, re-admissions after recompute preemptions hit the cache again, and the rate read
    "100% · 572 / 518 tokens". The rate is hit tokens over tokens looked up at every admission;
    the engine's own allocate() calls are the oracle."""
    from engine.core.block_manager import BlockManager
    looked_up, hits = [], []
    allocate = BlockManager.allocate

    def spy(self, seq, budget=None):
        cached = allocate(self, seq, budget)
        looked_up.append(len(seq))
        hits.append(cached)
        return cached

    monkeypatch.setattr(BlockManager, "allocate", spy)
    cfg = p.PoolConfig(block_size=1, num_device_blocks=256, num_host_blocks=128, preemption_mode="swap")
    eng = LLMEngine(EngineConfig(model="tiny", pool=cfg), load_model("tiny"))
    m = Mirror.from_snapshot(eng.snapshot())
    for cmd in SCENARIOS[0].build(cfg, 1):
        eng.add_request(messages=[{"role": x.role, "content": x.content} for x in cmd.messages],
                        params=SamplingParams(max_tokens=cmd.max_tokens, ignore_eos=True), request_id=cmd.request_id)
    eng.generate([])
    events = eng.drain_events()
    for ev in events:
        m.apply(ev)
        assert m.tally.hit_tokens <= m.tally.looked_up_tokens, ev
    recomputed = [e for e in events if isinstance(e, p.Preempt) and e.mode == "recompute"]
    assert recomputed and all(e.reason == "host_pool_full" for e in recomputed)  # swap mode fell back: says why
    assert len(looked_up) > len(SCENARIOS[0].build(cfg, 1))  # some requests were admitted twice
    assert (m.tally.looked_up_tokens, m.tally.hit_tokens) == (sum(looked_up), sum(hits))
    assert 0 < m.tally.hit_rate < 1


def test_counters_of_a_client_that_attached_late_say_since_when(recorded):
    """Bug 5: a page that attached mid-recording read "0% · 0 / 3,871 tokens"."""
    first, events, _ = recorded
    m = Mirror.from_snapshot(first)
    for ev in events[:len(events) // 2]:
        m.apply(ev)
    late = Mirror.from_snapshot(m.state.snapshot())
    for ev in events[len(events) // 2:]:
        late.apply(ev)
    assert late.tally.since == f"you attached (event {events[len(events) // 2 - 1].seq:,})"
    assert late.tally.hit_tokens <= late.tally.looked_up_tokens
    assert Mirror.from_snapshot(first).tally.since == "engine start"


def test_counters_after_an_earlier_reading_are_what_was_counted_since(recorded):
    """What a tab attached later shows: the counters after its attach equal those of a mirror that
    attached there itself, and the rate stays the whole stream's."""
    first, events, _ = recorded
    m = Mirror.from_snapshot(first)
    half = len(events) // 2
    for ev in events[:half]:
        m.apply(ev)
    base, late = m.tally.clone(), Mirror.from_snapshot(m.state.snapshot())
    for ev in events[half:]:
        m.apply(ev)
        late.apply(ev)
    since = m.tally.after(base, "you attached")
    assert since.since == "you attached" and since.tokens_per_s() == m.tally.tokens_per_s()
    for name in COUNTERS:
        assert getattr(since, name) == getattr(late.tally, name), name
    assert since.looked_up_tokens < m.tally.looked_up_tokens and not since.counted_nothing()
    assert m.tally.after(m.tally, "now").counted_nothing()


def test_a_resync_takes_what_the_skipped_events_counted_from_the_snapshots_counters(recorded):
    """A client that skipped events (a resync after it fell behind) ends with the counters of one
    that applied them all, a clean slate before the gap kept; across a skipped `reset` it counts
    from the reset, as the other does."""
    first, events, _ = recorded
    last = events[-1]
    reset = p.Reset(config=first.config, seq=last.seq + 1, step=last.step + 1, t=last.t)
    server, counter, snaps = PoolState.from_snapshot(first), StreamCounter(), {}
    for ev in [*events, reset]:  # the server's side: the pool and its tally at each event
        counter.observe(ev, server)
        server.apply(ev)
        if ev.seq in (events[len(events) // 2].seq, reset.seq):
            snaps[ev.seq] = msgspec.structs.replace(server.snapshot(), counters=counter.wire())
    start = msgspec.structs.replace(first, counters=StreamCounter().wire())
    full, gappy = EventHistory(start), EventHistory(start)
    quarter, half = len(events) // 4, len(events) // 2
    numbers = lambda h: {n: getattr(h.live.tally, n) for n in COUNTERS}
    for ev in events[:quarter]:
        full.append(ev), gappy.append(ev)
    full.clean_slate(), gappy.clean_slate()
    for ev in events[quarter:half + 1]:
        full.append(ev)
    gappy.resync(snaps[events[half].seq])
    for ev in events[half + 1:]:
        full.append(ev), gappy.append(ev)
    assert numbers(gappy) == numbers(full) and full.live.tally.preemptions and full.live.tally.finished
    assert gappy.live.tally.since == full.live.tally.since == f"the clean slate (event {events[quarter - 1].seq:,})"
    full.append(reset)
    gappy.resync(snaps[reset.seq])
    assert numbers(gappy) == numbers(full) and gappy.live.tally.since == full.live.tally.since


def test_usage_compares_contiguous_reservation_with_paging(recorded):
    first, events, _ = recorded
    m = Mirror.from_snapshot(first)
    for ev in events:
        m.apply(ev)
        if isinstance(ev, p.StepDone) and ev.step == 6:
            break
    st, bs = m.state, m.config.block_size
    holders = [s for s in st.seqs.values() if s.block_table]
    assert holders
    u = m.usage()
    free, cached, used, *_ = st.counts()
    assert (u["free"], u["cached"], u["used"]) == (free, cached, used)
    assert u["reserved_slots"] == sum(s.prompt_tokens + s.max_tokens for s in holders)
    assert u["paged_slots"] == used * bs
    held: dict[int, int] = {}  # the rule of docs/protocol.md, written out by hand
    for s in st.seqs.values():
        for i, b in enumerate(s.block_table):
            held[b] = max(held.get(b, 0), min(bs, max(0, s.num_tokens - i * bs)))
    in_blocks = sum(held.values())
    assert u["slot_util"] == pytest.approx(in_blocks / (used * bs))
    assert u["reserved_bytes"] == pytest.approx(u["reserved_slots"] * m.config.bytes_per_block / bs)


@pytest.mark.parametrize("every,limit", [(500, 100_000), (7, 100_000), (5, 60)])
def test_history_rebuilds_the_state_at_any_retained_event(recorded, every, limit):
    first, events, _ = recorded
    h = EventHistory(first, max_events=limit, checkpoint_every=every)
    for ev in events:
        h.append(ev)
    assert len(h.events) <= limit * 1.1 and h.last_event == events[-1].seq
    truth = {first.seq: PoolState.from_snapshot(first).snapshot()}
    s = PoolState.from_snapshot(first)
    for ev in events:
        s.apply(ev)
        truth[ev.seq] = s.snapshot()
    for n in random.Random(0).sample(range(h.first_event, h.last_event + 1), 40) + [h.first_event, h.last_event]:
        assert h.at(n).state.snapshot() == truth[n], n
    assert h.first_event >= h.events[0].seq - 1
    assert h.at(h.first_event - 10).last_event == h.first_event  # before the retained window: clamped


def test_history_steps_and_markers(recorded):
    first, events, _ = recorded
    h = EventHistory(first)
    for ev in events:
        h.append(ev)
    steps = [e for e in events if isinstance(e, p.StepDone)]
    assert [pt.step for pt in h.points] == [e.step for e in steps]
    assert {m.kind for m in h.markers} >= {"preempt", "swap_out", "swap_in"}
    mid = steps[5].seq
    assert all(e.step == steps[5].step for e in h.last_step_events(mid))
    nxt = h.step_edge(mid, forward=True)
    assert h.event(nxt).step == steps[6].step and isinstance(h.event(nxt), p.StepDone)
    assert h.event(h.step_edge(nxt, forward=False)).step == steps[5].step


def test_resync_after_a_gap_keeps_counters_and_travel_stops_at_the_gap(recorded):
    first, events, last = recorded
    h = EventHistory(first, checkpoint_every=10)
    half = len(events) // 2
    for ev in events[:half]:
        h.append(ev)
    before = h.live.tally.requests
    h.resync(last)  # events half.. never arrived
    assert h.live.state.snapshot() == PoolState.from_snapshot(last).snapshot()
    assert h.live.tally.requests == before
    assert h.at(last.seq).state.snapshot() == PoolState.from_snapshot(last).snapshot()
    assert h.at(events[half - 1].seq).last_event == events[half - 1].seq


def test_touched_picks_the_most_telling_kind():
    evs = [p.Alloc(seq_id="a", block_id=1, logical_index=0), p.Free(seq_id="a", block_id=1, ref_count=0),
           p.Cow(seq_id="b", logical_index=0, src_block_id=2, dst_block_id=3),
           p.SwapOut(seq_id="c", mapping=[(4, 0)])]
    dev, host = grid.touched(evs)
    code = {k: i + 1 for i, k in enumerate(grid.TOUCH_KINDS)}
    assert dev == {1: code["alloc"], 2: code["cow"], 3: code["cow"], 4: code["swap_out"]}
    assert host == {0: code["swap_out"]}


def test_event_log_filters_and_words(recorded):
    _, events, _ = recorded
    df = eventlog.frame(events, {"alloc", "cow"}, limit=50)
    assert set(df["kind"]) == {"alloc", "cow"} and list(df["event"]) == sorted(df["event"], reverse=True)
    cow = next(e for e in events if isinstance(e, p.Cow))
    only = eventlog.frame(events, set(p.EVENT_KINDS), seq=cow.seq_id, block=cow.dst_block_id)
    assert cow.seq in set(only["event"]) and all(str(cow.dst_block_id) in b.split() for b in only["blocks"])
    assert "copied to" in only[only["event"] == cow.seq]["what happened"].iloc[0]
    assert all(eventlog.describe(e)[2] for e in events)  # every kind has words


def test_scenarios_fit_the_pool_they_are_built_for():
    for cfg in (p.PoolConfig(), p.PoolConfig(block_size=8, num_device_blocks=8192)):
        for sc in SCENARIOS:
            cmds = sc.build(cfg, 3)
            subs = [c for c in cmds if isinstance(c, p.Submit)]
            assert subs and len({c.request_id for c in subs}) == len(subs)
            for c in cmds:  # what the server would accept, through its own parser
                p.parse_command(p.encode(c).decode())
    over = dict((sc.key, sc) for sc in SCENARIOS)["overload"]
    big = over.build(p.PoolConfig(block_size=8, num_device_blocks=8192), 1)
    assert isinstance(big[0], p.ResetCmd) and big[0].config.num_device_blocks * 8 <= 4096
    small = over.build(p.PoolConfig(), 1)
    assert not isinstance(small[0], p.ResetCmd) and all(c.ignore_eos for c in small)


def test_command_line_and_environment():
    assert from_command_line([], {}) == Source("embedded")
    assert from_command_line(["--model", "tiny", "--num-device-blocks", "1024"], {}) == Source(
        "embedded", model="tiny", engine_args=("--num-device-blocks", "1024"))
    attach = Source("attach", url="ws://h:1/", token="t")
    assert from_command_line(["--engine", "ws://h:1/", "--token", "t"], {}) == attach
    assert from_command_line([], {"KVSCOPE_ENGINE": "ws://x:2/"}).url == "ws://x:2/"
    rep = from_command_line(["--replay", "assets/x.jsonl", "--speed", "2"], {})
    assert rep.kind == "replay" and rep.path.endswith("assets/x.jsonl") and rep.speed == 2
    assert rep.server_args()[0] == "engine.serve.replay" and "--loop" in rep.server_args()[1]
    assert Source("embedded", model="tiny").server_args() == ("engine.serve.server", ("--model", "tiny", "--port", "0"))


def test_command_line_for_a_trace_to_play():
    t = from_command_line(["--trace", "t.jsonl", "--blocks", "4096", "--policy", "opt"], {})
    assert t.kind == "trace" and t.path.endswith("/t.jsonl") and t.label == "trace replay of t.jsonl"
    assert t.server_args() == ("engine.lab.trace_play", (t.path, "--port", "0", "--blocks", "4096", "--policy", "opt"))
    assert (t.trace_option("--blocks", "1"), t.trace_option("--block-size", "512")) == ("4096", "512")
    assert from_command_line([], {"KVSCOPE_TRACE": "u.jsonl"}).kind == "trace"


def test_command_line_for_vllm_and_its_kv_events():
    v = from_command_line(["--vllm", "--num-blocks", "64"], {})
    assert v == Source("vllm", engine_args=("--num-blocks", "64"))
    module, args = v.server_args()
    assert module == "integrations.vllm.serve" and python_for(module).endswith(".venv-vllm/bin/python")
    assert python_for("engine.serve.server") == sys.executable
    assert args == ("smollm2", "--port", "0", "--kvscope-port", "0", "--num-blocks", "64")
    assert from_command_line(["--vllm", "/models/q"], {}).server_args()[1][0] == "/models/q"
    k = from_command_line(["--kv-events", "tcp://h:5557?replay=tcp://h:5558", "--tokenizer", "/tok"], {})
    assert k == Source("kv_events", url="tcp://h:5557?replay=tcp://h:5558", tokenizer="/tok")
    assert from_command_line([], {"KVSCOPE_KV_EVENTS": "tcp://x:1"}).kind == "kv_events"


def test_the_dashboard_never_imports_torch():
    """It must start fast and attach to a remote engine on a machine without torch."""
    modules = ", ".join(".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                        for f in sorted((ROOT / "app").rglob("*.py"))
                        if f.stem not in ("__init__", "__main__", "main"))
    code = (f"import sys\nimport {modules}\n"
            "bad = [m for m in ('torch', 'transformers', 'engine.model.engine') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)
