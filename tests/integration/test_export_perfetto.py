"""The Perfetto export: the written file, decoded with the perfetto package's own protobuf
classes, holds a slice per request phase, the fork flows, the allocator's instants with their
block ids, and pool counters equal to the reducer's at every engine step."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState
from app.export.perfetto import COUNTERS, MISS_COUNTERS, export, ns
from kvscope_contract.misses import REASONS, ExplainedPool
from kvscope_contract.rebuild import with_rebuilt_prompts
from kvscope_contract.recording import Recording
from tests.perfetto_trace import decode

DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo_recording.jsonl"


def args_of(te: TrackEvent) -> dict:
    def value(a):
        if a.array_values:
            return [value(v) for v in a.array_values]
        return getattr(a, a.WhichOneof("value"))
    return {a.name: value(a) for a in te.debug_annotations}


def expected_phases(events: list[p.AnyEvent]) -> dict[str, list[tuple[str, int]]]:
    """Each sequence's phases as (name, start ns), read straight off the events (not the reducer)."""
    out: dict[str, list] = defaultdict(list)
    status: dict[str, str] = {}

    def enter(sid, name, t):
        if status.get(sid) != name:
            out[sid].append((name, ns(t)))
            status[sid] = name
    for ev in events:
        match ev:
            case p.RequestAdded():
                enter(ev.seq_id, "waiting", ev.t)
            case p.Fork():
                enter(ev.seq_id, status[ev.parent_seq_id], ev.t)
            case p.StatusChange():
                enter(ev.seq_id, {"running": "running", "waiting": "waiting", "swapped": "swapped out"}[ev.status],
                      ev.t)
            case p.Preempt():
                enter(ev.seq_id, "swapped out" if ev.mode == "swap" else "preempted", ev.t)
            case p.SwapIn():
                enter(ev.seq_id, "running", ev.t)
    return out


@pytest.fixture(scope="module")
def demo():
    rec = Recording(DEMO)
    events = [ev for batch in rec.batches for ev in batch]
    return rec, events, decode(export(PoolState.from_snapshot(rec.start), events))


def test_slices_are_the_phases_of_every_request(demo):
    rec, events, (names, parents, tevents) = demo
    by_name = {v: k for k, v in names.items()}
    seq_ids = [ev.seq_id for ev in events if isinstance(ev, (p.RequestAdded, p.Fork))]
    requests = {ev.request_id for ev in events if isinstance(ev, p.RequestAdded)}
    assert len(requests) == 21 and len(seq_ids) == 24
    for rid in requests:  # one track per request, under `requests`
        assert names[parents[by_name[rid]]] == "requests"
    want = expected_phases(events)
    finishes = {ev.seq_id: ev for ev in events if isinstance(ev, p.Finish)}
    for sid in seq_ids:
        track = by_name[sid]
        mine = [(ts, te) for ts, te in tevents if te.track_uuid == track]
        begins = [(te.name, ts) for ts, te in mine if te.type == TrackEvent.TYPE_SLICE_BEGIN]
        ends = [ts for ts, te in mine if te.type == TrackEvent.TYPE_SLICE_END]
        assert begins == want[sid], sid
        assert len(ends) == len(begins)  # every phase ended: each sequence finished
        # each phase ends where the next begins; the last at the finish, named with its reason
        assert ends[:-1] == [ts for _, ts in begins[1:]]
        fin = finishes[sid]
        assert ends[-1] == ns(fin.t)
        (last,) = [te for ts, te in mine if te.type == TrackEvent.TYPE_INSTANT and te.name.startswith("finished")]
        assert last.name == f"finished: {fin.reason}" and args_of(last)["reason"] == fin.reason
    # the demo preempts by swap three times: three "swapped out" phases, each back to running
    swapped = [(sid, ph) for sid, phs in want.items() for ph in phs if ph[0] == "swapped out"]
    assert len(swapped) == 3


def test_forks_are_flows_from_the_parent(demo):
    rec, events, (names, parents, tevents) = demo
    by_name = {v: k for k, v in names.items()}
    forks = [ev for ev in events if isinstance(ev, p.Fork)]
    assert len(forks) == 3
    for f in forks:
        (start,) = [te for _, te in tevents if f.seq in te.flow_ids]
        assert start.track_uuid == by_name[f.parent_seq_id] and args_of(start)["block_ids"] == f.block_ids
        (end,) = [te for _, te in tevents if f.seq in te.terminating_flow_ids]
        assert end.track_uuid == by_name[f.seq_id] and end.type == TrackEvent.TYPE_SLICE_BEGIN
        assert parents[by_name[f.seq_id]] == by_name[f.request_id]  # a child track of its request


def test_instants_carry_the_block_ids(demo):
    rec, events, (names, parents, tevents) = demo
    instants = [te for _, te in tevents if te.type == TrackEvent.TYPE_INSTANT]
    cows = [(a["src_block_id"], a["dst_block_id"]) for te in instants if te.name == "copy-on-write"
            for a in [args_of(te)]]
    assert cows == [(ev.src_block_id, ev.dst_block_id) for ev in events if isinstance(ev, p.Cow)]
    evicts = [args_of(te)["block_id"] for te in instants if te.name == "evict"]
    assert evicts == [ev.block_id for ev in events if isinstance(ev, p.Evict)] and len(evicts) == 251
    outs = [args_of(te) for te in instants if te.name == "swap out"]
    assert [list(zip(a["device_block_ids"], a["host_block_ids"])) for a in outs] == [
        [tuple(m) for m in ev.mapping] for ev in events if isinstance(ev, p.SwapOut)]
    ins = [args_of(te) for te in instants if te.name == "swap in"]
    assert len(ins) == 3
    preempts = [args_of(te) for te in instants if te.name == "preempt (swap)"]
    assert [a["block_ids"] for a in preempts] == [[d for d, _ in ev.mapping] for ev in events
                                                  if isinstance(ev, p.SwapOut)]  # what each held


def test_counters_equal_the_reducer_at_every_step(demo):
    rec, events, (names, parents, tevents) = demo
    counters = {uuid: name for uuid, name in names.items() if name in COUNTERS}
    got: dict[str, list] = defaultdict(list)
    for ts, te in tevents:
        if te.type == TrackEvent.TYPE_COUNTER and (name := counters.get(te.track_uuid)):
            got[name].append((ts, te.counter_value if te.HasField("counter_value") else te.double_counter_value))
    state, hit, looked = PoolState.from_snapshot(rec.start), 0, 0
    want: dict[str, list] = defaultdict(list)
    for ev in events:
        looked += state.prefix_lookup(ev)
        hit += state.config.block_size * isinstance(ev, p.PrefixHit)
        state.apply(ev)
        if isinstance(ev, p.StepDone):
            c = state.counts()
            assert (c.free, c.cached) == (ev.free_blocks, ev.cached_blocks)  # the engine's own numbers
            used = c.used * state.config.block_size
            for name, v in zip(COUNTERS, (*c, state.tokens_in_used_blocks() / used if used else 1.0,
                                          hit / looked if looked else 0.0)):
                want[name].append((ns(ev.t), v))
    steps = sum(isinstance(ev, p.StepDone) for ev in events)
    assert steps == 630
    for name in COUNTERS:
        assert len(got[name]) == steps
        assert [ts for ts, _ in got[name]] == [ts for ts, _ in want[name]], name
        assert [v for _, v in got[name]] == pytest.approx([v for _, v in want[name]], rel=1e-12), name
    assert max(v for _, v in got["host blocks in use"]) > 0 and max(v for _, v in got["shared blocks"]) > 0
    assert 0 < got["prefix hit rate"][-1][1] < 1


def test_each_admission_says_why_it_missed_and_each_eviction_flows_to_its_reuse(demo):
    """The reasons of kvscope_contract/misses.py, on the demo with its prompts rebuilt from block
    hashes (it has no token ids): an instant per admission, counters per reason, eviction flows."""
    rec, events, (names, parents, tevents) = demo
    pool = ExplainedPool.from_snapshot(rec.start, keep=None)
    for ev in with_rebuilt_prompts(rec.start, events)[0]:
        pool.apply(ev)
    x = pool.explainer
    by_name = {v: k for k, v in names.items()}
    lookups = [te for _, te in tevents if te.name.startswith("prefix lookup: ")]
    assert len(lookups) == len(x.admissions) == 21
    for te, a in zip(lookups, x.admissions):
        args = args_of(te)
        assert te.track_uuid == by_name[a.seq_id] and te.name == f"prefix lookup: {a.hit:,} of {a.tokens:,} hit"
        assert {k.removeprefix("missed "): v for k, v in args.items() if k.startswith("missed ")} == a.by_reason()
        assert sum(v for k, v in args.items() if k.startswith("missed ")) == args["tokens"] - args["hit_tokens"]
    # the tokens missed by reason, as counters: the explainer's totals at the last step
    last = {}
    for _, te in tevents:
        if te.type == TrackEvent.TYPE_COUNTER and names[te.track_uuid] in MISS_COUNTERS.values():
            last[names[te.track_uuid]] = te.counter_value
    assert {r: last[MISS_COUNTERS[r]] for r in REASONS} == {r: x.totals.by_reason.get(r, 0) for r in REASONS}
    assert x.totals.by_reason["evicted"] > 0 and x.totals.by_reason["unknown"] == 0
    # an eviction before reuse: a flow from its `evict` instant to the admission that missed it
    (reuse,) = [te for te in lookups if te.terminating_flow_ids]
    (source,) = [te for _, te in tevents if te.name == "evict" and reuse.terminating_flow_ids[0] in te.flow_ids]
    assert args_of(reuse)["evicted_at_events"] == list(reuse.terminating_flow_ids)
    assert names[source.track_uuid] == "evictions" and names[reuse.track_uuid] == "mix4-long1"


def test_cli_writes_the_trace(tmp_path):
    out = tmp_path / "run.pftrace"
    r = subprocess.run([sys.executable, "-m", "app.export.perfetto", str(DEMO), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names, _, events = decode(out.read_bytes())
    assert "load3-8" in names.values() and len(events) > 1000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "hello"\n')
    r = subprocess.run([sys.executable, "-m", "app.export.perfetto", str(bad), "-o", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a KVScope recording" in r.stderr and not (tmp_path / "x").exists()


def test_cli_finds_a_bundled_recording_by_name_and_writes_beside_the_input_or_here(tmp_path):
    """`kvscope-export demo_recording.jsonl` from any folder finds the bundled recording, as `kvscope
    --replay` does, and writes the trace in the current folder, never among the bundled files; a
    recording of one's own gets its trace beside it."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    here = tmp_path / "here"
    here.mkdir()
    r = subprocess.run([sys.executable, "-m", "app.export.perfetto", DEMO.name], cwd=here, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (here / "demo_recording.pftrace").exists() and not (DEMO.parent / "demo_recording.pftrace").exists()
    mine = tmp_path / "mine" / "run.jsonl"
    mine.parent.mkdir()
    mine.write_bytes(DEMO.read_bytes())
    r = subprocess.run([sys.executable, "-m", "app.export.perfetto", str(mine)], cwd=here, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (mine.parent / "run.pftrace").exists(), r.stderr
    r = subprocess.run([sys.executable, "-m", "app.export.perfetto", "no_such.jsonl"], cwd=here, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no_such.jsonl" in r.stderr and "bundled" in r.stderr


def test_the_dashboards_download_is_the_same_trace_and_survives_a_gap(demo):
    from app.history.event_history import EventHistory
    from app.panels.trace_download import history_trace, take

    rec, events, (names, parents, tevents) = demo
    h = EventHistory(rec.start, checkpoint_every=200)
    for ev in events:
        h.append(ev)
    _, _, got = decode(history_trace(*take(h)))
    assert [(ts, te) for ts, te in got] == tevents  # same uuids: the tracks are made in the same order

    # a client that lost events 1000-1999 resynced from a snapshot: the trace goes on from there
    h, state = EventHistory(rec.start), PoolState.from_snapshot(rec.start)
    for ev in events:
        state.apply(ev)
        if ev.seq < 1000:
            h.append(ev)
        elif ev.seq == 1999:
            h.resync(state.snapshot())
        elif ev.seq >= 2000:
            h.append(ev)
    start, kept, resyncs = take(h)
    assert list(resyncs) == [2000] and len(kept) == len(events) - 1000
    names, _, got = decode(history_trace(start, kept, resyncs))
    depth: dict[int, int] = defaultdict(int)
    for _, te in got:  # every slice ends, none twice: the gap closed the phases open at it
        depth[te.track_uuid] += (te.type == TrackEvent.TYPE_SLICE_BEGIN) - (te.type == TrackEvent.TYPE_SLICE_END)
        assert depth[te.track_uuid] >= 0
    assert not any(depth.values())
    steps = sum(isinstance(ev, p.StepDone) for ev in kept)
    assert sum(te.type == TrackEvent.TYPE_COUNTER for _, te in got) == steps * (len(COUNTERS) + len(MISS_COUNTERS))
    alive_at_gap = len(h.at(999).state.seqs)  # their phases end at the gap with a `resync` instant
    assert alive_at_gap and sum(te.name == "resync" for _, te in got) == alive_at_gap
