"""Hybrid pools: KV-cache groups of sliding-window and full-attention layers over one pool, as
vLLM v1's hybrid allocator keeps them (vllm/v1/core/kv_cache_coordinator.py)."""
from __future__ import annotations

import pytest

from kvscope_contract import protocol as p
from kvscope_contract.counters import EventCounts
from kvscope_contract.kv_groups import group_layers
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from engine.core.sequence import SamplingParams
from tests.pool_driver import PoolDriver
from tests.synthetic import synthetic_engine

NULL = p.NULL_BLOCK
BS, W = 4, 9  # a window of 9 tokens reads the last ceil(8 / 4) = 2 blocks before a position
SLIDING, FULL = 0, 1
GROUPS = [p.KVGroup(kind="sliding_window", sliding_window=W, layers=[0]), p.KVGroup(layers=[1])]


def driver(num_blocks: int = 64, **kw) -> PoolDriver:
    return PoolDriver(p.PoolConfig(block_size=BS, num_device_blocks=num_blocks, num_host_blocks=32,
                                   kv_groups=GROUPS, **kw))


def replayed(d: PoolDriver) -> PoolState:
    d.drain()
    state = d.replay()
    check_invariants(state)
    assert state.snapshot() == d.snapshot()
    return state


def test_gemma3_layers_group_as_vllm_groups_them():
    gemma3 = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # every sixth layer is global
    groups = group_layers(gemma3)
    assert [(g.kind, g.sliding_window, g.layers) for g in groups] == [
        ("sliding_window", 512, [0, 6, 12]), ("sliding_window", 512, [1, 7, 13]),
        ("sliding_window", 512, [2, 8, 14]), ("sliding_window", 512, [3, 9, 15]),
        ("sliding_window", 512, [4, 10, 16]), ("full_attention", None, [5, 11, 17])]
    # 12 sliding and 13 full (gpt-oss-20b's shape): buckets this close pad to the larger size
    assert [len(g.layers) for g in group_layers([128] * 12 + [None] * 13)] == [12, 13]
    assert group_layers([None] * 30) == []  # a full-attention model: the protocol's one group


def test_blocks_that_leave_the_window_are_freed_and_their_entries_become_null():
    d = driver()
    seq = d.add(list(range(8)))
    d.admit(seq)
    for t in range(12):
        d.decode(seq, t)
    # 8 + 12 = 20 tokens computed: position 20 reads 12..20, so blocks 0-2 (tokens 0-11) are
    # out, freed before the next step computes it
    d.bm.free_window(seq)
    events = d.drain()
    freed = [ev for ev in events if isinstance(ev, p.WindowFree)]
    assert sorted(ev.logical_index for ev in freed) == [0, 1, 2]
    assert all(ev.kv_group == SLIDING and ev.ref_count == 0 for ev in freed)
    d.bm.free_window(seq)
    assert not d.drain()  # nothing more until the window moves
    assert seq.block_tables[SLIDING][:3] == [NULL] * 3 and NULL not in seq.block_tables[SLIDING][3:]
    assert NULL not in seq.block_tables[FULL] and len(seq.block_tables[FULL]) == 5  # 20 tokens
    state = replayed(d)
    assert state.seqs[seq.seq_id].block_tables == seq.block_tables


def test_a_hit_needs_every_group_full_attention_from_the_start_a_window_only_its_last_blocks():
    d = driver()
    prompt = list(range(100, 124))  # 6 blocks
    a = d.add(prompt)
    d.admit(a)
    for t in range(8):
        d.decode(a, t)  # the window moves on: a's sliding blocks 0-3 are freed, still cached
    d.drain()
    counts, state = EventCounts(), d.replay()
    b = d.add(prompt[:16] + [7])  # 17 tokens: 4 full blocks can hit, never the last token
    d.admit(b)
    for ev in d.drain():
        counts.count(ev, state.prefix_lookup(ev), state.prefix_hit_tokens(ev))
        state.apply(ev)
    assert b.block_tables[FULL][:4] == a.block_tables[FULL][:4]
    # the window reads 2 blocks before position 16: blocks 2 and 3, which a's window freed
    assert b.block_tables[SLIDING][:2] == [NULL, NULL]
    hits = [ev for ev in d.events if isinstance(ev, p.PrefixHit) and ev.seq_id == b.seq_id]
    assert sorted((ev.kv_group, ev.logical_index) for ev in hits) == [
        (SLIDING, 2), (SLIDING, 3), (FULL, 0), (FULL, 1), (FULL, 2), (FULL, 3)]
    assert (counts.hit_tokens, counts.looked_up_tokens) == (16, 17)  # once, not once per group
    assert state.snapshot() == d.snapshot()


def test_a_window_whose_blocks_were_evicted_shortens_the_hit_that_full_attention_could_serve():
    d = driver(num_blocks=40)
    prompt = list(range(200, 232))  # 8 blocks
    a = d.add(prompt, max_tokens=64)
    d.admit(a)
    sliding_a = list(a.block_tables[SLIDING])
    for t in range(16):
        d.decode(a, t)  # a's sliding blocks leave the window: 5, 4, ..., 0 at once (from the
        #                 window's edge back, as vLLM frees them), then 6, 7, 8 (cached, in the LRU)
    # 48 tokens computed: a holds 12 full-attention blocks, and 3 sliding ones with 9 in the LRU
    assert (d.bm.num_free_blocks, d.bm.num_cached_blocks) == (40 - 12 - 3 - 9, 9)
    filler = d.add([9] * 4 * 9)  # 9 blocks in each group: the 16 free ones, then the LRU's 2 oldest
    assert d.admit(filler)
    gone = [ev.block_id for ev in d.drain() if isinstance(ev, p.Evict)]
    assert gone == sliding_a[5:3:-1] and all(d.bm.pool.ref_counts[b] for b in a.block_tables[FULL])
    d.finish(filler)  # room for b; its blocks join the LRU after a's
    b = d.add(prompt[:24] + [7])  # full attention holds all 6 blocks; the window's 4 and 5 are gone
    d.admit(b)
    hits = [ev for ev in d.drain() if isinstance(ev, p.PrefixHit) and ev.seq_id == b.seq_id]
    # the window needs blocks 4-5 to end a hit at 6: gone, so the hit ends at 4, on blocks 2-3
    assert sorted(ev.logical_index for ev in hits if ev.kv_group == FULL) == [0, 1, 2, 3]
    assert b.block_tables[SLIDING][:4] == [NULL, NULL, *sliding_a[2:4]]
    replayed(d)


def test_fork_shares_every_group_and_copy_on_write_copies_each_groups_last_block():
    d = driver()
    parent = d.add(list(range(6)))  # a full block and a partial one, in each group
    d.admit(parent)
    child = d.fork(parent)
    fork = d.drain()[-1]
    assert fork.block_tables == parent.block_tables and fork.block_ids == parent.block_tables[0]
    copies = d.decode(child, 1)
    assert [src for src, _ in copies] == [parent.block_tables[SLIDING][1], parent.block_tables[FULL][1]]
    cows = [ev for ev in d.drain() if isinstance(ev, p.Cow)]
    assert sorted(ev.kv_group for ev in cows) == [SLIDING, FULL]
    replayed(d)


def test_swap_keeps_the_null_entries_and_brings_every_group_back():
    d = driver()
    seq = d.add(list(range(12)))
    d.admit(seq)
    for t in range(8):
        d.decode(seq, t)
    before = [list(t) for t in seq.block_tables]
    assert NULL in before[SLIDING]
    d.swap_out(seq)
    assert [[h == NULL for h in t] for t in seq.host_tables] == [[b == NULL for b in t] for t in before]
    replayed(d)
    d.swap_in(seq)
    assert [[b == NULL for b in t] for t in seq.block_tables] == [[b == NULL for b in t] for t in before]
    replayed(d)
    d.recompute(seq)
    assert seq.block_tables == [[], []]
    replayed(d)


@pytest.mark.parametrize("config, words", [
    (dict(block_size=16, kv_groups=[p.KVGroup(kind="sliding_window", sliding_window=8), p.KVGroup()]),
     "sliding window of 8 tokens, smaller than a block of 16: use a block size of at most 8"),
    (dict(num_device_blocks=4, kv_groups=group_layers([512] * 5 + [None])),
     "4 device blocks (4 above the watermark) cannot give a request one block in each of the model's 6"),
])
def test_a_pool_its_groups_cannot_use_is_refused_with_the_numbers(config, words):
    with pytest.raises(p.CommandError, match=words.replace("(", r"\(").replace(")", r"\)")):
        PoolDriver(p.PoolConfig(**config))


def test_a_refused_reset_keeps_every_request():
    """The engine core checks a reset's pool before it drops anything: a window smaller than the
    new block size is refused, and the running request goes on."""
    engine = synthetic_engine(512, live=0, block_size=4, kv_groups=GROUPS)
    engine.add_tokens(list(range(30)), SamplingParams(max_tokens=8))
    engine.step()
    before = engine.snapshot()
    with pytest.raises(p.CommandError, match="smaller than a block of 16"):
        engine.reset(p.PoolConfig(block_size=16, num_device_blocks=512, kv_groups=GROUPS))
    assert engine.snapshot() == before and engine.seqs
