"""The host tier (engine/core/offload.py) against a reference model of its semantics, through the
real scheduler and block manager; replaying its events reproduces the snapshot; and the engine's
greedy tokens with blocks loaded back from the tier equal transformers' generate()."""
from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.core.events import EventLog
from engine.core.offload import HostTier
from engine.core.sequence import SamplingParams
from kvscope_contract import protocol as p
from kvscope_contract.invariants import check_invariants
from kvscope_contract.snapshot_codec import hash_hex
from kvscope_contract.state import PoolState
from tests.offload_model import ReferenceTier, counting_engine

KEYS = st.tuples(st.just(0), st.integers(1, 9))
OPS = st.lists(st.one_of(st.tuples(st.just("store"), KEYS), st.tuples(st.just("load"), KEYS),
                         st.tuples(st.just("touch"), KEYS), st.tuples(st.just("end_step"), st.none())),
               max_size=60)


@given(capacity=st.integers(1, 5), ops=OPS)
def test_the_tier_keeps_what_the_reference_keeps_in_the_same_lru_order(capacity, ops):
    log, ref = EventLog(), ReferenceTier(capacity)
    tier = HostTier(capacity, log)
    device = iter(range(10_000))
    for op, key in ops:
        if op == "store":
            stored = tier.store(next(device), key[0], key[1], (key[1],)) is not None
            assert stored == ref.store(key)
        elif op == "load":
            t = tier.find(key[0], key[1], (key[1],))
            assert (t is not None) == ref.load(key)
            if t is not None:
                tier.load(t, next(device), "s", 0)
        elif op == "touch":
            tier.touch(*key)
            ref.touch(key)
        else:
            tier.take_copies()
            tier.end_step()
            ref.end_step()
        assert list(tier.lru) == ref.ready and list(tier.pending) == ref.pending
        assert len(tier) + len(tier.free) == capacity
    evicted = [(e.kv_group, e.hash) for e in log.drain() if isinstance(e, p.OffloadEvict)]
    assert evicted == [(g, hash_hex(h)) for g, h in ref.evicted]


PREFIXES = [[1, 2, 3, 4] * 6, [5, 6, 7] * 8, [9] * 20]


def replayed(first: p.Snapshot, events: list[p.Event]) -> PoolState:
    state = PoolState.from_snapshot(first)
    for ev in events:
        device_hashes = {state.hash_of(b) for b in range(len(state.ref_counts)) if state.has_hash[b]}
        if isinstance(ev, p.OffloadLoad):  # a load only where the device missed
            assert ev.hash not in device_hashes
        state.apply(ev)
    check_invariants(state)
    return state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), device=st.integers(8, 24), host=st.integers(1, 16),
       mode=st.sampled_from(["swap", "recompute"]))
def test_random_traffic_replays_to_the_snapshot_and_loads_only_device_misses(seed, device, host, mode):
    rng = random.Random(seed)
    engine = counting_engine(block_size=4, num_device_blocks=device, num_host_blocks=8, max_num_seqs=4,
                             num_offload_blocks=host, preemption_mode=mode)
    first, events = engine.snapshot(), []
    for _ in range(rng.randint(3, 10)):
        prompt = rng.choice(PREFIXES)[:rng.randint(4, 20)] + [rng.randint(10, 40) for _ in range(rng.randint(0, 6))]
        try:
            engine.add_tokens(prompt, SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True))
        except p.CommandError:
            continue
        for _ in range(rng.randint(0, 4)):
            engine.step()
            events += engine.drain_events()
            assert replayed(first, events).snapshot() == engine.snapshot()
    while engine.has_unfinished():
        engine.step()
    events += engine.drain_events()
    assert replayed(first, events).snapshot() == engine.snapshot()
    tier = engine.block_manager.offload
    assert len(tier) == len(engine.snapshot().offload_blocks) <= host and not tier.pending


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_host_tier_and_only_then():
    """The shape of the lesson: A's prompt, then others that push it out of the device pool, then
    A's prompt again: every full block but the last token's is hit, on the device or in the host
    tier, where a device-only pool of the same size recomputes all but the device's."""
    def run(host: int) -> Counter:
        engine = counting_engine(block_size=4, num_device_blocks=16, num_host_blocks=0, num_offload_blocks=host,
                                 preemption_mode="recompute")
        first = engine.snapshot()
        a = [1, 2, 3, 4] * 5  # 20 tokens: blocks 0-3 full and hit-able (the 5th holds the last token)
        for prompt in (a, [5] * 30, [6] * 30, a):
            engine.add_tokens(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        events = engine.drain_events()
        assert replayed(first, events).snapshot() == engine.snapshot()
        return Counter(e.__struct_config__.tag for e in events)

    with_tier, without = run(32), run(0)
    assert with_tier["prefix_hit"] == without["prefix_hit"] < 4  # what the device kept of A (its head)
    assert with_tier["prefix_hit"] + with_tier["offload_load"] == 4 and without["offload_load"] == 0
    assert with_tier["offload_store"] == 5 + 2 * 7 and not with_tier["offload_evict"]  # each full block once


def test_a_hybrid_pool_or_no_prefix_cache_refuses_a_host_tier():
    with pytest.raises(p.CommandError, match="host tier"):
        counting_engine(num_offload_blocks=4, enable_prefix_caching=False)
    groups = [p.KVGroup(kind="sliding_window", sliding_window=32, layers=[0]), p.KVGroup(layers=[1])]
    with pytest.raises(p.CommandError, match="host tier"):
        counting_engine(num_offload_blocks=4, kv_groups=groups)


def test_greedy_tokens_with_blocks_loaded_from_the_host_tier_equal_transformers(tiny):
    """The tiny model on its real kernels: a prompt's blocks pushed out of a small device pool come
    back from the host tier (a real copy of their K/V), and every token still equals generate()'s."""
    from tests.tiny_engine import hf_greedy, make
    engine = make(tiny, block_size=4, num_device_blocks=24, num_host_blocks=0, num_offload_blocks=64,
                  preemption_mode="recompute")
    tok = tiny.tokenizer
    system = tok("You are a helpful assistant who answers briefly and precisely.").input_ids
    fillers = [tok(", ".join(map(str, range(1, 22)))).input_ids, tok("The quick brown fox. " * 7).input_ids]
    prompts = [system + tok(" Why is the sky blue?").input_ids, *fillers, system + tok(" Name a prime.").input_ids]
    first, events, outs = engine.snapshot(), [], []
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for ids in prompts:  # one at a time: the ones between push the system prompt out of the device
        (out,), = engine.generate([ids], params)
        outs.append(out)
        events += engine.drain_events()
    loads = [e for e in events if isinstance(e, p.OffloadLoad)]
    assert loads and {e.seq_id for e in loads} == {outs[-1].seq_id}
    assert replayed(first, events).snapshot() == engine.snapshot()
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny, ids, params.max_tokens)


def test_an_old_recording_replays_and_knows_no_host_tier():
    """Protocol 3 adds the tier; the bundled demo recording (protocol 1) still replays event by
    event onto its snapshot, every invariant holding, with an empty host tier."""
    from pathlib import Path
    from kvscope_contract.recording import Recording
    rec = Recording(Path(__file__).resolve().parents[2] / "assets" / "demo_recording.jsonl")
    assert rec.hello.protocol == 1 < p.PROTOCOL_VERSION == 3
    state = PoolState.from_snapshot(rec.start)
    for batch in rec.batches:
        for ev in batch:
            state.apply(ev)
    check_invariants(state)
    assert state.config.num_offload_blocks == 0 and not state.snapshot().offload_blocks
    assert '"offload_blocks"' not in p.encode(state.snapshot()).decode()  # omitted while empty


def test_the_host_tier_survives_both_snapshot_forms():
    engine = counting_engine(block_size=4, num_device_blocks=16, num_offload_blocks=8)
    engine.add_tokens(list(range(1, 18)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    state = engine.capture().state()
    assert len(state.offload_blocks()) == 4
    for snap in (state.snapshot(), state.columnar_snapshot()):
        again = PoolState.from_snapshot(p.decode_server_message(p.encode_snapshot(snap)))
        assert again.offload_blocks() == state.offload_blocks() and again.snapshot() == state.snapshot()


def test_the_misses_say_hit_in_the_host_tier_and_still_add_up():
    """The dashboard's "why not more?" on the lesson's shape: A's blocks the device evicted and the
    host tier served are `host_tier`, not `evicted`; every missed token has one reason."""
    from kvscope_contract.misses import ExplainedPool
    engine = counting_engine(block_size=4, num_device_blocks=16, num_offload_blocks=32, preemption_mode="recompute")
    explained = ExplainedPool.from_snapshot(engine.snapshot())
    a = [1, 2, 3, 4] * 5
    for prompt in (a, [5] * 30, [6] * 30, a):
        engine.add_tokens(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    events = engine.drain_events()
    loads = sum(isinstance(e, p.OffloadLoad) for e in events)
    closed = [adm for ev in events if (adm := explained.apply(ev)) is not None]
    last = [adm for adm in closed if adm.seq_id == "r4"][-1]
    assert last.by_reason()["host_tier"] == loads * 4 > 0 and "evicted" not in last.by_reason()
    assert sum(last.by_reason().values()) == last.missed == 20 - last.hit


def test_the_servers_counters_of_a_run_with_a_host_tier_go_on_the_wire():
    """Every snapshot a server sends carries its tally (`StreamCounter.wire`): the host tier's
    counts travel with the rest, and decode to what was folded (a field the wire lacked broke
    every snapshot of every server)."""
    from kvscope_contract.counters import STREAM_COUNTERS, StreamCounter
    engine = counting_engine(block_size=4, num_device_blocks=16, num_offload_blocks=32, preemption_mode="recompute")
    state, counter = PoolState.from_snapshot(engine.snapshot()), StreamCounter()
    a = [1, 2, 3, 4] * 5
    for prompt in (a, [5] * 30, [6] * 30, a):
        engine.add_tokens(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    for ev in engine.drain_events():
        counter.observe(ev, state)
        state.apply(ev)
    snap = msgspec.structs.replace(state.snapshot(), counters=counter.wire())
    wired = p.decode_server_message(p.encode_snapshot(snap)).counters
    assert {n: getattr(wired, n) for n in STREAM_COUNTERS} == counter.counts.numbers()
    assert wired.host_loaded_blocks > 0 and wired.host_stored_blocks > 0


def test_what_paging_saves_says_what_the_host_tier_holds_and_what_its_loads_saved():
    """The header's card on a pool with a host tier (the lesson's shape): the tier's blocks that
    hold content and the blocks its loads brought back, as the events count them; none without a tier."""
    from app.history.event_history import EventHistory
    from app.panels.header import reservation_card
    from tests.histories import view_at

    def card(host: int) -> tuple[str, list[p.Event]]:
        engine = counting_engine(block_size=4, num_device_blocks=16, num_offload_blocks=host,
                                 preemption_mode="recompute")
        h = EventHistory(engine.snapshot(), checkpoint_every=50)
        a = [1, 2, 3, 4] * 5
        for prompt in (a, [5] * 30, [6] * 30, a):
            engine.add_tokens(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        events = engine.drain_events()
        for ev in events:
            h.append(ev)
        return reservation_card(view_at(h, h.last_event)), events

    text, events = card(32)
    loads = sum(isinstance(e, p.OffloadLoad) for e in events)
    stores = sum(isinstance(e, p.OffloadStore) for e in events) - sum(isinstance(e, p.OffloadEvict) for e in events)
    assert loads and f"Host tier: <b>{stores:,}</b> of 32 blocks hold a stored block" in text
    assert f"<b>{loads} blocks</b> loaded back instead of computed again ({loads * 4} tokens" in text
    assert "Host tier" not in card(0)[0]
