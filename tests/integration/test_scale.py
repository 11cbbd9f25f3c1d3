"""Production-size pools through the real server: the engine with its model replaced by random
logits (engine/synthetic.py) on pools of up to a million blocks. A client that asks for
`columnar` snapshots and a v1 client that never heard of features see the same pool; a
million-block snapshot is encoded beside the engine and the other clients, never in their way."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from websockets.sync.client import connect

from engine.config import EngineConfig
from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState, check_invariants
from engine.synthetic import SyntheticEngine

ROOT = Path(__file__).resolve().parents[2]


def synthetic(blocks: int, live: int, fill: float = 0.0, **pool) -> SyntheticEngine:
    cfg = EngineConfig(model="synthetic", max_num_batched_tokens=2048, pool=p.PoolConfig(
        num_device_blocks=blocks, num_host_blocks=pool.pop("host", 1024), max_num_seqs=pool.pop("seqs", 64), **pool))
    engine = SyntheticEngine(cfg, live, prompt_tokens=256, max_tokens=64)
    engine.fill(fill)
    return engine


class Mirror:
    """A protocol client mirroring the pool with the reducer; `features` go in its URL."""

    def __init__(self, url: str, features: str | None = None):
        self.ws = connect(url + (f"?features={features}" if features else ""), max_size=None, max_queue=None, legacy=True,
                          open_timeout=10)
        self.hello = json.loads(self.ws.recv(timeout=30))
        self.frames: list[dict] = []
        self.state: PoolState | None = None

    def read(self, until, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            self.frames.append({"type": msg["type"], "keys": sorted(msg)})
            if msg["type"] == "snapshot":
                self.snapshot = msg
                self.state = PoolState.from_snapshot(p.decode_server_message(json.dumps(msg)))
            elif msg["type"] == "events" and self.state is not None:
                for ev in p.decode_server_message(json.dumps(msg)).events:
                    self.state.apply(ev)
            if until(msg):
                return msg

    def resync(self) -> dict:
        self.ws.send(json.dumps({"op": "snapshot", "id": "again"}))
        self.read(lambda m: m.get("id") == "again")
        return self.read(lambda m: m["type"] == "snapshot")


@pytest.fixture
def serve(serve_engine):
    def start(engine: SyntheticEngine, step_delay_ms: float = 5):
        return serve_engine(engine, step_delay_ms=step_delay_ms)

    return start


def test_the_protocol_takes_production_sizes():
    big = {"op": "reset", "config": {"num_device_blocks": 1 << 20, "num_host_blocks": 1 << 18, "max_num_seqs": 4096}}
    assert p.parse_command(json.dumps(big)).config.num_device_blocks == 1 << 20
    for field, value in (("num_device_blocks", (1 << 20) + 1), ("num_host_blocks", (1 << 18) + 1), ("max_num_seqs", 4097)):
        with pytest.raises(p.CommandError, match=field):
            p.parse_command(json.dumps({"op": "reset", "config": {field: value}}))


@pytest.mark.slow
def test_a_columnar_client_and_a_v1_client_see_the_same_pool(serve):
    srv = serve(synthetic(1 << 16, live=48, fill=0.5, host=256))
    v1, col = Mirror(srv.url), Mirror(srv.url, "columnar,no-such-feature")
    assert v1.hello["features"] == [] and col.hello["features"] == ["columnar"]
    v1.read(lambda m: m["type"] == "snapshot")
    col.read(lambda m: m["type"] == "snapshot")
    assert len(v1.snapshot["device_blocks"]) == 1 << 16 and "columns" not in v1.snapshot
    assert col.snapshot["device_blocks"] == [] and set(col.snapshot["columns"]) >= {"ref_count", "hashes"}
    assert len(json.dumps(col.snapshot)) < len(json.dumps(v1.snapshot)) / 2
    for c in (v1, col):  # both follow the stream for a while, then compare with a fresh snapshot
        target = c.state.last_event + 2000
        c.read(lambda m: m["type"] == "events" and m["events"][-1]["seq"] > target)
        mirrored = c.state.snapshot()
        fresh = PoolState.from_snapshot(p.decode_server_message(json.dumps(c.resync())))
        assert fresh.last_event >= mirrored.seq
        check_invariants(fresh)
    srv.backend.pacing.paused = True
    mirrored = []
    for c in (v1, col):  # every event up to the pause applied: each mirror must equal the server's pool
        try:
            c.read(lambda m: False, timeout=1.5)
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
    srv = serve(synthetic(1 << 20, live=32, seqs=32), step_delay_ms=10)
    watcher = Mirror(srv.url, "columnar")
    watcher.read(lambda m: m["type"] == "snapshot")
    watcher.read(lambda m: m["type"] == "events")
    late = Mirror(srv.url)  # a v1 client: a million block objects, encoded while the rest goes on
    steps_before = srv.backend.steps_run
    seen = len(watcher.frames)
    late.read(lambda m: m["type"] == "snapshot")
    watcher.ws.send(json.dumps({"op": "pace", "step_delay_ms": 10, "id": "p"}))
    watcher.read(lambda m: m.get("id") == "p")
    during = [f for f in watcher.frames[seen:] if f["type"] == "events"]
    assert len(during) >= 5, "the other client got no events while the snapshot was encoded"
    assert srv.backend.steps_run - steps_before >= 5
    assert len(late.snapshot["device_blocks"]) == 1 << 20
    late.read(lambda m: m["type"] == "events")
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
from kvscope_contract.state import PoolState, check_invariants
from tests.integration.test_scale import synthetic
engine = synthetic(2048, live=24, seqs=16, host=256, block_size=16)
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
