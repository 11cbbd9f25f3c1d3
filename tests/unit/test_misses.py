"""Every prefix-cache miss explained (kvscope_contract/misses.py): each reason produced by a workload
built for it and run through the real scheduler and block manager (the lab, no model), and random
workloads where the reasons add up to the misses exactly and agree with the engine's own hashes."""
from __future__ import annotations

import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.lab.sim import Lab
from engine.lab.workload import Request, Workload
from kvscope_contract import protocol as p
from kvscope_contract.counters import EventCounts
from kvscope_contract.lab import LabConfig
from kvscope_contract.misses import REASONS, ExplainedPool, MissExplainer
from kvscope_contract.rebuild import with_rebuilt_prompts
from kvscope_contract.recording import Recording
from kvscope_contract.snapshot_codec import hash_hex

ROOT = Path(__file__).resolve().parents[2]


def run(requests: list[Request], pool: p.PoolConfig, **kw) -> tuple[p.Snapshot, list[p.AnyEvent], Lab]:
    """The requests through the real engine core, step by step, every event kept."""
    lab = Lab(LabConfig(pool=pool, **kw), Workload("test", requests), keep_events=True)
    start = lab.snapshot()
    lab.run(fast=False)
    return start, lab.meter.pending, lab


def explain(start: p.Snapshot, events: list[p.AnyEvent]) -> tuple[MissExplainer, EventCounts]:
    pool, counts = ExplainedPool.from_snapshot(start), EventCounts()
    for ev in events:
        counts.count(ev, pool.state.prefix_lookup(ev), pool.state.prefix_hit_tokens(ev))
        pool.apply(ev)
    return pool.explainer, counts


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def of(x: MissExplainer, seq_id: str, readmission: bool = False):
    return next(a for a in x.admissions if a.seq_id == seq_id and a.readmission == readmission)


def spans(a) -> list[tuple[str, int, int]]:
    return [(s.reason, s.start, s.end) for s in a.spans]


def assert_accounts(x: MissExplainer, counts: EventCounts) -> None:
    """The reasons add up to each admission's misses, in order, and the totals are the counters'."""
    for a in x.admissions:
        pos = a.hit
        for s in a.spans:
            assert s.reason in REASONS and s.start == pos and s.end > s.start, (a, s)
            pos = s.end
        assert pos == a.tokens, a
        assert sum(a.by_reason().values()) == a.missed
    t = x.totals
    assert (t.looked_up, t.hit) == (counts.looked_up_tokens, counts.hit_tokens)
    assert sum(t.by_reason.values()) == t.missed


# ---------------------------------------------------------------------------------- each reason
def test_a_new_prompt_is_cold_up_to_its_last_full_block_and_partial_after():
    start, events, _ = run([Request("a", 0, toks(1, 40), [[7, 8]], 2)], p.PoolConfig(block_size=16))
    x, counts = explain(start, events)
    assert spans(of(x, "a")) == [("cold", 0, 32), ("partial_block", 32, 40)]
    assert_accounts(x, counts)


def test_a_shared_prompt_shorter_than_a_block_never_hits():
    """vLLM #54607: a system prompt shorter than one block gives a 0% hit rate, rightly."""
    system = toks(2, 10)
    reqs = [Request(f"r{i}", 4 * i, system + toks(10 + i, 5), [[1, 2]], 2) for i in range(3)]
    start, events, _ = run(reqs, p.PoolConfig(block_size=16))
    x, counts = explain(start, events)
    for a in x.admissions:
        assert a.hit == 0 and spans(a) == [("partial_block", 0, 15)]
    assert_accounts(x, counts)


def test_the_block_holding_the_last_token_is_computed_even_when_cached():
    """The same 32-token prompt again: its first block hits, its second (the last token's) cannot."""
    prompt = toks(3, 32)
    start, events, _ = run([Request("a", 0, prompt, [[5]], 1), Request("b", 4, prompt, [[5]], 1)],
                           p.PoolConfig(block_size=16))
    x, counts = explain(start, events)
    b = of(x, "b")
    assert b.hit == 16 and spans(b) == [("partial_block", 16, 32)]
    assert_accounts(x, counts)


def test_a_prompt_that_parts_from_cached_content_inside_a_block_diverged_there():
    """A 40-token system prompt with block size 16: the second request hits blocks 0-1, shares 8
    tokens of block 2 with the first request's cached block 2, and parts from it there."""
    system = toks(4, 40)
    reqs = [Request("a", 0, system + toks(5, 20), [[1, 2, 3]], 3), Request("b", 5, system + toks(6, 20), [[4]], 1)]
    start, events, _ = run(reqs, p.PoolConfig(block_size=16))
    x, counts = explain(start, events)
    b = of(x, "b")
    assert b.hit == 32
    assert spans(b) == [("diverged", 32, 40), ("cold", 40, 48), ("partial_block", 48, 60)]
    assert_accounts(x, counts)


def test_content_evicted_before_reuse_names_the_eviction_and_the_allocation_that_made_it():
    """A 12-token prompt cached (blocks of 4), then other prompts fill the 12-block pool, then the
    first prompt again: its two full blocks were evicted, each by a named request's allocation."""
    prompt = toks(7, 12)
    reqs = ([Request("a", 0, prompt, [[1]], 1)]
            + [Request(f"fill{i}", 3 + 3 * i, toks(20 + i, 30), [[2]], 1) for i in range(2)]
            + [Request("again", 12, prompt, [[3]], 1)])
    start, events, _ = run(reqs, p.PoolConfig(block_size=4, num_device_blocks=12))
    x, counts = explain(start, events)
    again = of(x, "again")
    assert again.hit == 0 and spans(again) == [("evicted", 0, 8), ("partial_block", 8, 12)]
    by_event = {ev.seq: ev for ev in events}
    for e in again.spans[0].evictions:
        ev = by_event[e.event]
        assert isinstance(ev, p.Evict) and ev.block_id == e.block_id and e.event < again.event
        taker = by_event[e.event + 1]  # the allocation that took the block comes right after
        assert e.how == "alloc" and isinstance(taker, p.Alloc) and taker.block_id == e.block_id
        assert e.by_seq == taker.seq_id and e.by_request.startswith("fill")
    assert_accounts(x, counts)


def test_content_cleared_from_the_prefix_cache_is_evicted_by_no_allocation():
    prompt = toks(8, 20)
    lab = Lab(LabConfig(pool=p.PoolConfig(block_size=4)), Workload("clear", []), keep_events=True)
    start = lab.snapshot()
    for rid in ("a", "b"):
        lab._add(Request(rid, 0, prompt, [[1, 2]], 2))
        while lab.scheduler.has_work():
            lab.step()
        if rid == "a":
            assert lab.clear_prefix_cache() == 5  # its 20 prompt tokens fill 5 blocks
    x, counts = explain(start, lab.meter.pending)
    b = of(x, "b")
    assert spans(b) == [("evicted", 0, 16), ("partial_block", 16, 20)]
    assert [e.how for e in b.spans[0].evictions] == ["clear"] * 4
    assert all(e.by_seq is None for e in b.spans[0].evictions)
    assert_accounts(x, counts)


def test_a_readmission_after_a_recompute_preemption_is_kept_apart():
    """Two long generations in a pool too small for both: the newest is preempted by recompute and
    admitted again, its misses `recomputed`, outside vLLM's first-admission counters."""
    reqs = [Request("a", 0, toks(9, 8), [toks(10, 30)], 30), Request("b", 0, toks(11, 8), [toks(12, 30)], 30)]
    start, events, _ = run(reqs, p.PoolConfig(block_size=4, num_device_blocks=14, preemption_mode="recompute"))
    assert any(isinstance(ev, p.Preempt) and ev.mode == "recompute" for ev in events)
    x, counts = explain(start, events)
    again = [a for a in x.admissions if a.readmission]
    assert again and all({s.reason for s in a.spans} == {"recomputed"} for a in again)
    assert x.totals.by_reason["recomputed"] == sum(a.missed for a in again)
    first = [a for a in x.admissions if not a.readmission]
    assert x.totals.first_looked_up == sum(a.looked_up for a in first)
    assert x.totals.first_hit == sum(a.hit for a in first)
    assert_accounts(x, counts)


def test_with_prefix_caching_off_every_token_misses_for_that_and_none_is_looked_up():
    prompt = toks(13, 20)
    start, events, _ = run([Request("a", 0, prompt, [[1]], 1), Request("b", 3, prompt, [[1]], 1)],
                           p.PoolConfig(block_size=4, enable_prefix_caching=False))
    x, counts = explain(start, events)
    for a in x.admissions:
        assert a.looked_up == 0 and spans(a) == [("caching_off", 0, 20)]
    assert x.totals.looked_up == 0 and x.totals.by_reason == {"caching_off": 40}
    assert_accounts(x, counts)


SLIDING_AND_FULL = [p.KVGroup(kind="sliding_window", sliding_window=9, layers=[0]), p.KVGroup(layers=[1])]


def test_in_a_hybrid_pool_a_window_that_lost_its_blocks_shortens_the_hit_full_attention_had():
    """A sliding window of 9 tokens (blocks of 4) and full attention: a long generation's prompt
    blocks leave its window and are evicted from the sliding group by a filler, while full
    attention keeps them; the same prompt again hits only as far as the window still has a run."""
    prompt = list(range(200, 232))
    reqs = [Request("a", 0, prompt, [list(range(1, 41))], 40), Request("filler", 16, [9] * 36, [[1]], 1),
            Request("b", 18, prompt[:24] + [7], [[2]], 1)]
    start, events, _ = run(reqs, p.PoolConfig(block_size=4, num_device_blocks=40, kv_groups=SLIDING_AND_FULL))
    x, counts = explain(start, events)
    b = of(x, "b")
    full = {ev.logical_index for ev in events if isinstance(ev, p.PrefixHit) and ev.seq_id == "b" and ev.kv_group == 1}
    assert b.hit == 4 * len(full) == 8
    assert spans(b) == [("window", 8, 24), ("partial_block", 24, 25)]
    assert_accounts(x, counts)


def test_the_demo_recording_accounts_for_every_missed_token():
    """It has no prompt token ids: as recorded, its missed full blocks are `unknown`; with the
    prompts rebuilt from its block hashes (as the lab replays it) every one has a reason."""
    rec = Recording(ROOT / "assets" / "demo_recording.jsonl")
    events = [ev for batch in rec.batches for ev in batch]
    raw, counts = explain(rec.start, events)
    assert raw.totals.by_reason["unknown"] > 0
    rebuilt, n = with_rebuilt_prompts(rec.start, events)
    assert n == raw.totals.admissions
    x, counts = explain(rec.start, rebuilt)
    assert_accounts(x, counts)
    assert x.totals.by_reason["unknown"] == 0 and x.totals.missed == x.totals.tokens - x.totals.hit > 0
    assert {"cold", "partial_block", "evicted"} <= set(x.totals.by_reason)


# ---------------------------------------------------------------------------------- random workloads
PREFIXES = [toks(100 + i, 48) for i in range(3)]


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    reqs = []
    for i in range(draw(st.integers(1, 12))):
        prefix = PREFIXES[draw(st.integers(0, 2))][:draw(st.integers(0, 48))]
        tail = draw(st.lists(st.integers(1, 6), max_size=20))
        prompt = (prefix + tail) or [1]
        n = draw(st.integers(1, 3))
        outs = [draw(st.lists(st.integers(1, 6), min_size=1, max_size=40)) for _ in range(n)]
        reqs.append(Request(f"r{i}", draw(st.integers(0, 12)), prompt, outs, 40))
    hybrid = draw(st.booleans())  # a sliding window of W tokens beside full attention
    groups = [p.KVGroup(kind="sliding_window", sliding_window=draw(st.sampled_from([bs, 2 * bs + 1])), layers=[0]),
              p.KVGroup(layers=[1])] if hybrid else []
    need = (1 + hybrid) * (max(-(-(len(r.prompt) + 40) // bs) for r in reqs) + 2)  # every request fits alone
    pool = p.PoolConfig(block_size=bs, num_device_blocks=draw(st.integers(need, need * 2)),
                        num_host_blocks=draw(st.integers(0, need * 2)),
                        enable_prefix_caching=draw(st.booleans()),
                        preemption_mode=draw(st.sampled_from(["swap", "recompute"])), kv_groups=groups)
    return reqs, pool, draw(st.sampled_from([32, 1024]))


def engine_hashes(lab: Lab, tokens: list[int], blocks: int) -> list[str]:
    """The engine's own chain hashes of a sequence's first full blocks (BlockManager's rule)."""
    seq = Sequence("oracle", "oracle", list(tokens))
    return [hash_hex(BlockManager._block_hash(lab.block_manager, seq, i)) for i in range(blocks)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_every_miss_has_one_reason_that_the_engines_hashes_confirm(case):
    reqs, pool, budget = case
    start, events, lab = run(reqs, pool, max_num_batched_tokens=budget)
    x, counts = explain(start, events)
    assert_accounts(x, counts)
    assert x.totals.admissions == sum(isinstance(ev, p.StatusChange) for ev in events)
    # an oracle of the engine's hashes: what the full-attention group had cached at each admission,
    # and ever before it (a block's chained hash is the same in every group)
    full = len(pool.groups) - 1
    admissions = {a.event: a for a in x.admissions}
    tokens: dict[str, list[int]] = {}
    ever, now = set(), {}
    evicts = {ev.seq: ev for ev in events if isinstance(ev, p.Evict)}
    for ev in events:
        match ev:
            case p.RequestAdded():
                tokens[ev.seq_id] = list(ev.prompt_token_ids)
            case p.Fork():
                tokens[ev.seq_id] = list(tokens[ev.parent_seq_id])
            case p.Append():
                tokens[ev.seq_id] += ev.token_ids
            case p.Cached() if ev.kv_group == full:
                ever.add(ev.hash)
                now[ev.block_id] = ev.hash
            case p.Evict():
                now.pop(ev.block_id, None)
        a = admissions.get(ev.seq)
        if a is None or not pool.enable_prefix_caching or a.readmission:
            continue
        bs, cached = pool.block_size, set(now.values())
        hashes = engine_hashes(lab, tokens[a.seq_id], (a.tokens - 1) // bs)
        assert all(h in cached for h in hashes[:a.hit // bs])
        for s in a.spans:
            for i in range(s.start // bs, -(-s.end // bs)):
                if s.reason == "partial_block":
                    assert i >= len(hashes)
                elif s.reason in ("cold", "diverged"):
                    assert hashes[i] not in ever, (a, s)
                elif s.reason == "window":
                    assert pool.kv_groups and hashes[i] in cached, (a, s)
                else:
                    assert s.reason == "evicted" and hashes[i] in ever, (a, s)
            for e in s.evictions:
                assert evicts[e.event].block_id == e.block_id and e.event < a.event
