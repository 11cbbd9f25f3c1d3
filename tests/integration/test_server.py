"""The engine server end to end: a real server on loopback, real websockets clients."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies
from websockets.exceptions import InvalidStatus

from kvscope_contract import protocol as p
from engine.config import EngineConfig
from engine.model.engine import LLMEngine
from engine.serve.admission import Admission
from engine.serve.hub import Hub, serve_in_thread
from engine.serve.replay import Playback
from kvscope_contract.recording import Recording
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from kvscope_contract.counters import STREAM_COUNTERS
from tests.protocol_client import Client, pool_of
from tests.prompts import SYSTEM


@pytest.fixture
def make_server(tiny, serve_engine):
    def make(pool: dict | None = None, memory_fraction: float = 0.5, **kw):
        cfg = EngineConfig(model="tiny", pool=p.PoolConfig(**(pool or {})), memory_fraction=memory_fraction)
        return serve_engine(LLMEngine(cfg, tiny), **kw)

    return make


def test_hello_snapshot_then_submit_ack_and_events_through_finish(make_server, tiny):
    srv = make_server()
    c = Client(srv.url)
    assert c.hello["protocol"] == p.PROTOCOL_VERSION == 3 and c.hello["engine"]["num_kv_heads"] == 2
    assert c.hello["config"]["bytes_per_block"] == 16 * 2 * 2 * 16 * 2 * tiny.dtype.itemsize
    assert c.state.last_event == 0 and len(c.state.ref_counts) == 256
    ack = c.request(op="submit", prompt="Hello there", max_tokens=5, ignore_eos=True, id=42)
    assert ack == {"type": "ack", "op": "submit", "id": 42, "request_id": "r1", "seq_ids": ["r1"]}
    c.sync(c.finished("r1"))
    assert c.kinds["request_added"] == 1 and c.kinds["append"] == 5 and c.kinds["finish"] == 1
    assert not c.state.seqs and sum(c.state.ref_counts) == 0


def test_two_clients_receive_identical_event_streams(make_server):
    srv = make_server()
    a, b = Client(srv.url), Client(srv.url)
    a.request(op="submit", prompt=SYSTEM + "Hi", max_tokens=8, n=2, temperature=0.5, seed=3)
    streams = []
    for c in (a, b):
        frames = []
        c.sync(lambda m: m["type"] == "events" and frames.append(m["events"]) is None
               and any(e["kind"] == "finish" and e["seq_id"] == "r1.1" for e in m["events"]))
        streams.append([e for f in frames for e in f])
    assert streams[0] == streams[1] and len(streams[0]) > 10


def test_a_client_that_stops_reading_is_resynchronised_while_others_stream(make_server):
    srv = make_server(pool={"num_device_blocks": 1024}, max_queued_events=8)
    fast = Client(srv.url)
    slow = Client(srv.url, max_queue=1)
    for i in range(4):
        fast.request(op="submit", prompt=f"story {i}", max_tokens=3000, ignore_eos=True)
    start = srv.backend.steps_run
    # `slow` reads nothing while the engine runs on and `fast` keeps up
    lagging = lambda: [c for c in srv.hub.clients if c.resyncs]
    fast.until(lambda: lagging() or srv.backend.steps_run > start + 2500, timeout=120)
    assert lagging() and fast.snapshots == 1  # only the stalled client was resynchronised
    fast.until(lambda: srv.backend.steps_run > start + 1000, timeout=120)  # and all went on
    slow.sync(lambda m: m["type"] == "snapshot" and slow.snapshots >= 2, timeout=60)
    # after the resync its mirror continues from the snapshot's seq: it matches a fresh one
    slow.request(op="pause")
    fresh = slow.request(op="snapshot") and slow.sync(lambda m: m["type"] == "snapshot")
    assert slow.state.snapshot() == pool_of(fresh)
    assert srv.backend.steps_run > start + 1000


INT, TEXT, JUST, ONE_OF = strategies.integers, strategies.text, strategies.just, strategies.one_of


def _command(**fields) -> strategies.SearchStrategy:
    return strategies.fixed_dictionaries(fields).map(json.dumps)


INVALID_COMMANDS = ONE_OF(
    TEXT(max_size=50).filter(lambda s: not s.strip().startswith(("{", "[", '"')) or len(s) < 2),
    strategies.binary(min_size=1, max_size=64),
    ONE_OF(INT(), strategies.lists(INT(), max_size=3), strategies.none(), strategies.booleans()).map(json.dumps),
    _command(op=TEXT(max_size=12).filter(lambda s: s not in p.COMMANDS)),
    _command(op=JUST("submit"), prompt=JUST("x"),
             max_tokens=ONE_OF(INT(max_value=0), INT(min_value=4097), TEXT(max_size=3),
                               strategies.floats(allow_nan=False), JUST(10**40))),
    _command(op=JUST("submit"), prompt=JUST("x"), n=ONE_OF(INT(max_value=0), INT(min_value=17), strategies.booleans())),
    _command(op=JUST("submit"), prompt=ONE_OF(INT(), JUST(""), strategies.none())),
    _command(op=JUST("step"), count=ONE_OF(INT(max_value=0), INT(min_value=10_001))),
    _command(op=JUST("pace"), step_delay_ms=ONE_OF(strategies.floats(max_value=-0.01),
                                                   strategies.floats(min_value=10_000.01), TEXT(max_size=4))),
    _command(op=JUST("reset"), config=strategies.fixed_dictionaries({
        "block_size": ONE_OF(INT(max_value=0), INT(min_value=257), strategies.sampled_from([3, 12, 100]))})),
    _command(op=strategies.sampled_from(sorted(p.COMMANDS)), bogus_field=INT()),
    _command(op=JUST("abort"), request_id=ONE_OF(INT(), strategies.none())),
)


def test_a_thousand_hostile_messages_each_get_an_error_and_the_server_still_serves(make_server):
    srv = make_server()
    c = Client(srv.url)
    frames: list = []

    @settings(max_examples=1000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(INVALID_COMMANDS)
    def collect(frame):
        frames.append(frame)

    collect()
    assert len(frames) >= 1000
    for frame in frames:
        c.ws.send(frame)
    codes = Counter()
    for _ in frames:
        msg = c.sync(lambda m: m["type"] in ("ack", "error"))
        assert msg["type"] == "error" and msg["message"], msg
        codes[msg["code"]] += 1
    assert set(codes) <= {"bad_json", "unknown_op", "invalid_argument"} and len(codes) == 3
    ack = c.request(op="submit", prompt="still there?", max_tokens=3, ignore_eos=True)
    c.sync(c.finished(ack["request_id"]))


def test_oversized_frames_are_refused_with_1009(make_server):
    srv = make_server()
    c = Client(srv.url)
    c.ws.send(json.dumps({"op": "submit", "prompt": "x" * (1 << 20)}))
    with pytest.raises(Exception):
        c.recv(timeout=10)
    assert c.ws.close_code == 1009
    Client(srv.url).request(op="pause")  # the server lives on


def test_the_token_is_enforced_at_the_handshake(make_server):
    srv = make_server(token="s3cret")
    for url in (srv.url, srv.url + "?token=wrong"):
        with pytest.raises(InvalidStatus) as e:
            Client(url)
        assert e.value.response.status_code == 401
    Client(srv.url + "?token=s3cret").request(op="pause")
    Client(srv.url, additional_headers={"Authorization": "Bearer s3cret"}).request(op="pause")


def test_get_tokenize_answers_the_engines_own_token_ids_behind_its_token(make_server, tiny):
    """The fleet page scores a typed prompt with these ids (app.fleet.engines.tokenize)."""
    srv = make_server(token="s3cret")
    http = srv.url.replace("ws://", "http://").rstrip("/")
    text = "A prompt, typed: with punctuation and ünïcode."
    ask = lambda query, headers={"Authorization": "Bearer s3cret"}: urllib.request.urlopen(
        urllib.request.Request(f"{http}/tokenize?{query}", headers=headers), timeout=10)
    with ask(urllib.parse.urlencode({"prompt": text})) as r:
        body = json.loads(r.read())
    assert body == {"tokens": tiny.tokenizer.encode(text, add_special_tokens=False), "count": len(body["tokens"])}
    for query, headers, code in (("prompt=x", {}, 401), ("", {"Authorization": "Bearer s3cret"}, 400)):
        with pytest.raises(urllib.error.HTTPError) as e:
            ask(query, headers)
        assert e.value.code == code


def test_binding_beyond_loopback_needs_a_token():
    out = subprocess.run([sys.executable, "-m", "engine.serve.server", "--host", "0.0.0.0", "--model", "tiny"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--token" in out.stderr


def test_pause_step_resume_and_pace(make_server):
    srv = make_server()
    c = Client(srv.url)
    assert c.request(op="step")["code"] == "busy"
    assert c.request(op="pause")["type"] == "ack"
    before = srv.backend.steps_run
    c.request(op="submit", prompt="one step at a time", max_tokens=20, ignore_eos=True)
    assert c.request(op="step", count=3)["type"] == "ack"
    c.until(lambda: c.kinds["step"] == 3)
    c.request(op="pause")  # a barrier: the engine thread has run every command before it
    assert srv.backend.steps_run == before + 3 and c.kinds["step"] == 3
    assert c.request(op="pace", step_delay_ms=5)["type"] == "ack" and srv.backend.pacing.step_delay_ms == 5
    late = Client(srv.url)  # a client that joins learns the loop's state from hello
    assert late.hello["paused"] is True and late.hello["step_delay_ms"] == 5
    c.request(op="resume")
    c.sync(c.finished("r1"))
    assert c.kinds["append"] == 20


def test_reset_changes_the_config_and_every_client_gets_reset_and_a_snapshot(make_server):
    srv = make_server(memory_fraction=0.01)
    a, b = Client(srv.url), Client(srv.url)
    a.request(op="submit", prompt="soon gone", max_tokens=500, ignore_eos=True)
    ack = a.request(op="reset", config={"block_size": 8, "num_device_blocks": 64,
                                        "preemption_mode": "recompute"})
    assert ack["type"] == "ack"
    for c in (a, b):
        c.until(lambda: c.snapshots == 2 and c.state.config.block_size == 8)
        assert c.kinds["reset"] == 1 and len(c.state.ref_counts) == 64 and not c.state.seqs
    bad = a.request(op="reset", config={"num_device_blocks": 65536, "block_size": 256})
    assert bad["code"] == "invalid_argument" and "GiB" in bad["message"]
    assert a.request(op="snapshot") and a.sync(lambda m: m["type"] == "snapshot")["config"]["block_size"] == 8


def test_clear_prefix_cache_emits_evicts(make_server):
    srv = make_server()
    c = Client(srv.url)
    ack = c.request(op="submit", prompt=SYSTEM * 3, max_tokens=2)
    c.sync(c.finished(ack["request_id"]))
    cached = c.state.counts().cached
    assert cached >= 3
    c.request(op="clear_prefix_cache")
    c.until(lambda: c.kinds["evict"] >= cached)
    assert c.state.counts().cached == 0


def test_errors_for_engine_commands_carry_their_codes(make_server):
    srv = make_server(pool={"num_device_blocks": 16, "block_size": 4})
    c = Client(srv.url)
    assert c.request(op="submit", prompt="word " * 100)["code"] == "too_long"
    assert c.request(op="abort", request_id="nobody")["code"] == "not_found"
    c.request(op="submit", prompt="x", request_id="dup", max_tokens=30, ignore_eos=True)
    assert c.request(op="submit", prompt="x", request_id="dup")["code"] == "duplicate_id"
    assert c.request(op="abort", request_id="dup")["type"] == "ack"


def workload(c: Client) -> None:
    """Prefix hits, parallel sampling (fork + CoW: a 7-token prompt leaves a partial block),
    and overload (preemption + swap)."""
    for i in range(3):
        c.request(op="submit", prompt=SYSTEM + f"Question {i}?", max_tokens=12, ignore_eos=True)
    c.request(op="submit", prompt="Name three colours and a number:", n=4, temperature=0.9, seed=1, max_tokens=12,
              ignore_eos=True)
    for i in range(6):
        c.request(op="submit", prompt=f"Tell a long story number {i}.", max_tokens=60, ignore_eos=True)


def test_a_mirroring_client_holds_exactly_what_a_fresh_snapshot_says(make_server):
    srv = make_server(pool={"block_size": 4, "num_device_blocks": 64, "num_host_blocks": 128,
                            "max_num_seqs": 16})
    c = Client(srv.url)
    c.request(op="pause")
    workload(c)
    c.request(op="step", count=40)
    c.until(lambda: c.kinds["step"] == 40)
    assert c.state.seqs  # mid-run
    fresh = c.request(op="snapshot") and c.sync(lambda m: m["type"] == "snapshot")
    mid = c.state.snapshot()
    c.request(op="resume")
    c.until(lambda: not c.state.seqs and c.kinds["finish"] >= 13, timeout=120)
    check_invariants(c.state)
    assert {"prefix_hit", "cached", "fork", "cow", "preempt", "swap_out", "swap_in"} <= set(c.kinds)
    assert mid == pool_of(fresh)
    tally = c.wire.mirror.tally  # what this client counted since `fresh` (its mirror starts at each snapshot)
    end = c.request(op="snapshot") and c.sync(lambda m: m["type"] == "snapshot")
    assert c.state.snapshot() == pool_of(end)
    # the server's counters fold every kind of event as the client does: their growth is its tally
    assert {k: end["counters"].get(k, 0) - fresh["counters"].get(k, 0) for k in STREAM_COUNTERS} == \
        {k: getattr(tally, k) for k in STREAM_COUNTERS} and tally.preemptions and tally.swap_ins


def run_replay(path, speed: float = 1.0, loop: bool = False):
    return serve_in_thread(Hub(Playback(Recording(path), speed, loop)))


def test_a_reconnect_loop_gets_in_at_the_hubs_admission_rate():
    """Issue 37: a client reconnecting in a loop costs the serving process (vLLM's, for the
    plugin) a handshake, a hello and a snapshot each time. With an admission of a burst of 2 and
    4 a second, six connections in a row take at least (6 - 2) / 4 s: the loop is slowed, and
    each one still gets its hello and snapshot. A connection whose turn is too far off gets a 503."""
    demo = Recording(Path(__file__).resolve().parents[2] / "assets" / "demo_recording.jsonl")
    serving = serve_in_thread(Hub(Playback(demo, 1.0, False), admission=Admission(rate=4.0, burst=2)))
    start = time.monotonic()
    for _ in range(6):
        c = Client(serving.url)
        assert c.snapshots == 1
        c.ws.close()
    assert time.monotonic() - start >= 0.99
    serving.stop()
    # a turn further off than the admission's longest wait: refused at once, to try again later
    serving = serve_in_thread(Hub(Playback(demo, 1.0, False), admission=Admission(rate=0.5, burst=1, max_wait_s=1.0)))
    Client(serving.url).ws.close()
    with pytest.raises(InvalidStatus) as refused:
        Client(serving.url)
    assert refused.value.response.status_code == 503
    serving.stop()


def test_replaying_a_recording_reproduces_the_recorded_final_state(make_server, tmp_path):
    path = tmp_path / "run.jsonl"
    srv = make_server(pool={"block_size": 4, "num_device_blocks": 64, "num_host_blocks": 128},
                      record=path)
    c = Client(srv.url)
    workload(c)
    c.until(lambda: not c.state.seqs and c.kinds["finish"] >= 13, timeout=120)
    final = c.state.snapshot()
    srv.stop()
    replaying = run_replay(path, speed=1000.0)
    viewer = Client(replaying.url)
    assert viewer.hello["replay"] is True
    viewer.until(lambda: viewer.state.last_event == final.seq)
    assert viewer.state.snapshot() == final
    assert viewer.request(op="submit", prompt="x")["code"] == "unsupported"
    assert viewer.request(op="reset")["code"] == "unsupported"
    replaying.stop()


def test_replay_pauses_steps_and_loops(tmp_path, make_server):
    path = tmp_path / "run.jsonl"
    srv = make_server(record=path)
    c = Client(srv.url)
    ack = c.request(op="submit", prompt="short", max_tokens=4, ignore_eos=True)
    c.sync(c.finished(ack["request_id"]))
    srv.stop()
    replaying = run_replay(path, loop=True)
    playback = replaying.backend
    v = Client(replaying.url)
    v.request(op="pause")
    played = playback.batches_played
    v.request(op="step", count=2)
    v.until(lambda: playback.batches_played >= played + 2)
    assert v.request(op="resume")["type"] == "ack"
    v.until(lambda: v.kinds["reset"] >= 1 and v.snapshots >= 2)
    v.until(lambda: v.kinds["finish"] >= 2)  # the second pass
    last = v.state.last_event
    v.request(op="pause")
    fresh = v.request(op="snapshot") and v.sync(lambda m: m["type"] == "snapshot")
    assert fresh["seq"] >= last and v.state.snapshot() == pool_of(fresh)
    # the replay's own tally, sent with it, counts the pass since its `reset`
    reset = next(ev for ev in v.events if isinstance(ev, p.Reset))
    assert fresh["counters"]["since"] == reset.seq and fresh["counters"]["requests"] == 1
    replaying.stop()


def test_replay_never_imports_torch():
    code = "import sys, engine.serve.replay; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_shipped_demo_recording_replays_consistently_and_shows_every_mechanism():
    from pathlib import Path

    from kvscope_contract.recording import Recording

    path = Path(__file__).resolve().parents[2] / "assets" / "demo_recording.jsonl"
    assert path.stat().st_size < 2_000_000
    rec = Recording(path)
    assert rec.hello.engine.model == "SmolLM2-135M-Instruct"
    state = PoolState.from_snapshot(rec.start)
    kinds = Counter()
    for batch in rec.batches:
        for ev in batch:
            state.apply(ev)
            kinds[ev.__struct_config__.tag] += 1
    check_invariants(state)
    assert {"prefix_hit", "cow", "fork", "swap_out", "swap_in", "preempt", "evict"} <= set(kinds)
    assert kinds["request_added"] == kinds["finish"] - kinds["fork"] and not state.seqs


def test_run_until_stops_at_the_first_key_event_and_every_client_that_asked_hears_it(make_server):
    srv = make_server(pool={"block_size": 8})
    teacher = Client(srv.url + "?features=loop")
    v1 = Client(srv.url)  # a client of protocol v1: no new message types reach it
    assert teacher.hello["features"] == ["loop"] and v1.hello["features"] == []
    teacher.request(op="pause")
    teacher.sync(lambda m: m["type"] == "loop" and m["paused"])
    teacher.request(op="submit", prompt="A library at night: " * 3, n=4, temperature=0.8, seed=1, max_tokens=12)
    assert teacher.request(op="run_until", kinds=["fork"])["type"] == "ack"
    stop = teacher.sync(lambda m: m["type"] == "loop" and m["paused"] and m["stopped_at"] is not None)
    teacher.until(lambda: teacher.state.last_event >= stop["stopped_at"])
    assert teacher.kinds["fork"] == 3 and teacher.last_event.seq >= stop["stopped_at"]
    assert len(teacher.state.seqs) == 4 and {s.status for s in teacher.state.seqs.values()} == {"running"}
    assert teacher.kinds["step"] == 1 and not teacher.kinds["cow"]
    # paused there: the next step the engine runs is the one asked for (a step counter, not a sleep)
    steps = srv.backend.steps_run
    teacher.request(op="step")
    teacher.until(lambda: teacher.kinds["step"] == 2)
    assert srv.backend.steps_run == steps + 1 and teacher.kinds["step"] == 2
    assert v1.request(op="snapshot")["type"] == "ack"
    v1.sync(lambda m: m["type"] == "snapshot")
    assert all(r["type"] in ("ack", "error") for r in v1.replies)  # never a `loop` message
    assert teacher.request(op="run_until", kinds=["bogus"])["code"] == "invalid_argument"


def test_pause_and_pace_reach_every_client_that_asked(make_server):
    srv = make_server()
    a, b = Client(srv.url + "?features=loop"), Client(srv.url + "?features=loop,unknown")
    assert b.hello["features"] == ["loop"]  # unknown features are not granted
    a.request(op="pause")
    assert b.sync(lambda m: m["type"] == "loop")["paused"] is True
    a.request(op="pace", step_delay_ms=250)
    assert b.sync(lambda m: m["type"] == "loop")["step_delay_ms"] == 250
    c = Client(srv.url)
    assert (c.hello["paused"], c.hello["step_delay_ms"]) == (True, 250)


def test_replay_loops_keep_event_numbers_steps_and_times_rising(tmp_path, make_server):
    path = tmp_path / "run.jsonl"
    srv = make_server(record=path)
    c = Client(srv.url)
    c.sync(c.finished(c.request(op="submit", prompt="loop me", max_tokens=6, ignore_eos=True)["request_id"]))
    srv.stop()
    replaying = run_replay(path, speed=100.0, loop=True)
    v = Client(replaying.url)
    seen: list = []
    v.take = lambda msg, take=v.take: (take(msg), msg["type"] == "events" and seen.extend(msg["events"]))
    v.until(lambda: v.kinds["reset"] >= 2, timeout=60)
    replaying.stop()
    for key in ("seq", "step", "t"):
        values = [e[key] for e in seen]
        assert values == sorted(values), f"{key} goes back"
    assert len({e["step"] for e in seen if e["kind"] == "step"}) == v.kinds["step"]  # no step number twice


def test_a_recording_cut_short_replays_every_whole_event_and_says_what_it_skipped(tmp_path):
    from app.link.launcher import ServerProcess
    from pathlib import Path
    data = (Path(__file__).resolve().parents[2] / "assets" / "demo_recording.jsonl").read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[:300_000])  # the engine was killed while recording
    whole = Recording(cut)
    proc = ServerProcess("engine.serve.replay", [str(cut), "--port", "0", "--speed", "1000"]).start()
    try:
        assert proc.wait_ready(30), "\n".join(proc.tail(20))
        assert any(f"line {len(data[:300_000].splitlines())}" in line and "cut short" in line for line in proc.lines)
        v = Client(proc.url)
        last = whole.batches[-1][-1].seq  # the last whole event
        v.until(lambda: v.state.last_event == last, timeout=60)
        check_invariants(v.state)
    finally:
        proc.stop()
    garbage = tmp_path / "garbage.jsonl"
    lines = data.splitlines()
    garbage.write_bytes(b"\n".join(lines[:40] + [b"not json at all"] + lines[41:]))
    assert "line 41 of" in Recording(garbage).damage
