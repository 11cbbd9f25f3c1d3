"""Production-size pools through the real server: the engine with its model replaced by random
logits (engine/synthetic.py) on pools of up to a million blocks. A client that asks for
`columnar` snapshots and a v1 client that never heard of features see the same pool; a
million-block snapshot is encoded beside the engine and the other clients, never in their way."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope_contract import protocol as p
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from engine.synthetic import SyntheticEngine
from tests.protocol_client import Client
from tests.synthetic import synthetic_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def serve(serve_engine):
    def start(engine: SyntheticEngine, step_delay_ms: float = 5):
        return serve_engine(engine, step_delay_ms=step_delay_ms)

    return start


def test_the_protocol_takes_production_sizes():
    big = {"op": "reset", "config": {"num_device_blocks": 1 << 20, "num_host_blocks": 1 << 18, "max_num_seqs": 4096}}
    assert p.parse_command(json.dumps(big)).config.num_device_blocks == 1 << 20
    for field, value in (("num_device_blocks", (1 << 20) + 1), ("num_host_blocks", (1 << 18) + 1),
                         ("max_num_seqs", 4097)):
        with pytest.raises(p.CommandError, match=field):
            p.parse_command(json.dumps({"op": "reset", "config": {field: value}}))


@pytest.mark.slow
def test_a_columnar_client_and_a_v1_client_see_the_same_pool(serve):
    srv = serve(synthetic_engine(1 << 16, live=48, fill=0.5, host=256))
    v1, col = Client(srv.url, max_queue=None), Client(srv.url, features=("columnar", "no-such-feature"), max_queue=None)
    assert v1.hello["features"] == [] and col.hello["features"] == ["columnar"]
    assert len(v1.snapshot["device_blocks"]) == 1 << 16 and "columns" not in v1.snapshot
    assert col.snapshot["device_blocks"] == [] and set(col.snapshot["columns"]) >= {"ref_count", "hashes"}
    assert len(json.dumps(col.snapshot)) < len(json.dumps(v1.snapshot)) / 2
    for c in (v1, col):  # both follow the stream for a while, then compare with a fresh snapshot
        target = c.state.last_event + 2000
        c.sync(lambda m: m["type"] == "events" and m["events"][-1]["seq"] > target, timeout=120)
        mirrored = c.state.snapshot()
        fresh = PoolState.from_snapshot(p.decode_server_message(json.dumps(c.resync(timeout=120))))
        assert fresh.last_event >= mirrored.seq
        check_invariants(fresh)
    srv.backend.pacing.paused = True
    mirrored = []
    for c in (v1, col):  # every event up to the pause applied: each mirror must equal the server's pool
        try:
            c.sync(lambda m: False, timeout=1.5)
        except TimeoutError:
            pass
        mirrored.append(c.state.snapshot())
    a, b = v1.resync(), col.resync()
    assert a["seq"] == b["seq"] == mirrored[0].seq == mirrored[1].seq
    fresh = PoolState.from_snapshot(p.decode_server_message(json.dumps(a))).snapshot()
    assert fresh == PoolState.from_snapshot(p.decode_server_message(json.dumps(b))).snapshot()
    assert mirrored[0] == fresh and mirrored[1] == fresh


@pytest.mark.slow
def test_a_million_block_snapshot_holds_up_neither_the_engine_nor_other_clients(serve):
    srv = serve(synthetic_engine(1 << 20, live=32, seqs=32), step_delay_ms=10)
    watcher = Client(srv.url, features=("columnar",), max_queue=None)
    watcher.sync(lambda m: m["type"] == "events", timeout=120)
    steps_before = srv.backend.steps_run
    seen = len(watcher.types)
    late = Client(srv.url, max_queue=None)  # a v1 client: a million block objects, encoded while the rest goes on
    watcher.request(op="pace", step_delay_ms=10)
    during = [t for t in watcher.types[seen:] if t == "events"]
    assert len(during) >= 5, "the other client got no events while the snapshot was encoded"
    assert srv.backend.steps_run - steps_before >= 5
    assert len(late.snapshot["device_blocks"]) == 1 << 20
    late.sync(lambda m: m["type"] == "events", timeout=120)
    check_invariants(late.state)


def test_hashes_in_any_form_round_trip_through_the_reducer_and_both_snapshots():
    """The reducer keeps hashes as numbers; one not in the protocol's form is kept as given."""
    cfg = p.PoolConfig(block_size=2, num_device_blocks=4, num_host_blocks=0)
    st = PoolState.empty(cfg)
    odd, plain = "sha256:9f2c…", "00ff00ff00ff00ff"
    for i, ev in enumerate([
            p.RequestAdded(request_id="r", seq_id="r", prompt_tokens=4),
            p.Alloc(seq_id="r", block_id=0, logical_index=0), p.Alloc(seq_id="r", block_id=1, logical_index=1),
            p.Cached(block_id=0, hash=plain), p.Cached(block_id=1, hash=odd)], start=1):
        ev.seq = i
        st.apply(ev)
    assert (st.hash_of(0), st.hash_of(1), st.hash_of(2)) == (plain, odd, None)
    for snap in (st.snapshot(), st.columnar_snapshot()):
        back = PoolState.from_snapshot(p.decode_server_message(p.encode_snapshot(snap)))
        assert back.snapshot() == st.snapshot() and back.hash_of(1) == odd
    for i, ev in enumerate([p.Free(seq_id="r", block_id=1, ref_count=0), p.Evict(block_id=1, hash=odd)], start=6):
        ev.seq = i
        st.apply(ev)
    assert st.hash_of(1) is None and not st.odd_hashes


def test_the_synthetic_load_drives_the_real_allocator_without_torch():
    """engine/synthetic.py is the engine core (scheduler, block manager, prefix cache, forks) with
    random tokens: no torch imported, and its events replayed by the reducer give its snapshot."""
    script = """
import sys
from collections import Counter
from kvscope_contract import protocol as p
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from tests.synthetic import synthetic_engine
engine = synthetic_engine(2048, live=24, seqs=16, host=256, block_size=16)
start = PoolState.from_snapshot(engine.snapshot())
kinds = Counter()
for _ in range(300):
    engine.step()
    for ev in engine.drain_events():
        start.apply(ev)
        kinds[type(ev).__name__] += 1
check_invariants(start)
assert start.snapshot() == engine.snapshot(), "replaying the events does not give the snapshot"
assert type(engine.block_manager).__module__ == "engine.core.block_manager"
assert all(kinds[k] for k in ("Alloc", "Cached", "PrefixHit", "Fork", "Free", "Finish")), kinds
assert "torch" not in sys.modules, "the synthetic load imported torch"
print("ok", dict(kinds))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
