"""Scenarios, each named for the allocator mechanism it shows."""
from __future__ import annotations

import pytest

from kvscope_contract import protocol as p
from kvscope_contract.kinds import words
from engine.core.block_manager import NoFreeBlocks
from engine.core.sequence import SeqStatus
from tests.pool_driver import PoolDriver

SYSTEM = list(range(100, 148))  # 48 tokens: three full blocks of 16


def kinds(events) -> list[str]:
    return [ev.__struct_config__.tag for ev in events]


def driver(**kw) -> PoolDriver:
    return PoolDriver(p.PoolConfig(**{"num_device_blocks": 32, "num_host_blocks": 16, **kw}))


def test_shared_system_prompt_hits_cached_blocks_for_the_2nd_and_3rd_request():
    d = driver()
    first = d.add(SYSTEM + [1, 2, 3])
    assert d.admit(first)
    cached = [ev for ev in d.drain() if isinstance(ev, p.Cached)]
    assert [ev.block_id for ev in cached] == first.block_table[:3]
    assert cached[0].parent_hash is None and cached[1].parent_hash == cached[0].hash

    others = [d.add(SYSTEM + [9, 9, i]) for i in range(2)]
    for seq in others:
        assert d.admit(seq)
        hits = [ev for ev in d.drain() if isinstance(ev, p.PrefixHit)]
        assert [ev.block_id for ev in hits] == first.block_table[:3]
        assert seq.block_table[:3] == first.block_table[:3]
        assert seq.block_table[3] != first.block_table[3]  # the private continuation
    assert [d.bm.pool.ref_counts[b] for b in first.block_table] == [3, 3, 3, 1]
    assert d.replay().snapshot() == d.snapshot()


def test_fork_n4_then_different_appends_copies_only_the_shared_last_block():
    d = driver()
    parent = d.add(list(range(20)))  # one full block and a partial one (4 of 16)
    d.admit(parent)
    children = [d.fork(parent) for _ in range(3)]
    family = [parent, *children]
    full, last = parent.block_table
    assert d.bm.pool.ref_counts[full] == d.bm.pool.ref_counts[last] == 4
    d.drain()
    cows = [d.decode(seq, next_token=i) for i, seq in enumerate(family)]
    events = d.drain()
    assert kinds(events).count("cow") == 3
    assert [len(c) for c in cows] == [1, 1, 1, 0]  # the last writer keeps it
    assert {src for (src, _), in cows[:3]} == {last}
    assert all(ev.logical_index == 1 for ev in events if isinstance(ev, p.Cow))
    assert all(seq.block_table[0] == full for seq in family) and d.bm.pool.ref_counts[full] == 4
    assert len({seq.block_table[1] for seq in family}) == 4 and children[2].block_table[1] == last
    assert all(d.bm.pool.ref_counts[seq.block_table[1]] == 1 for seq in family)
    assert d.replay().snapshot() == d.snapshot()


def test_cow_copies_only_the_partial_block_and_keeps_full_ones_shared():
    d = driver()
    parent = d.add(list(range(20)))
    d.admit(parent)
    src = parent.block_table[1]
    child = d.fork(parent)
    d.drain()
    assert d.decode(child, 5) == [(src, child.block_table[1])]
    (cow,) = [ev for ev in d.drain() if isinstance(ev, p.Cow)]
    assert (cow.seq_id, cow.logical_index, cow.src_block_id) == (child.seq_id, 1, src)
    assert d.decode(parent, 6) == []  # now the only holder: writes in place
    assert parent.block_table[1] == src and child.block_table[0] == parent.block_table[0]


def test_exhaustion_then_swap_out_and_back_in_restores_tables_in_logical_order():
    d = driver(num_device_blocks=8, num_host_blocks=8, enable_prefix_caching=False)
    a = d.add(list(range(40)))  # 3 blocks
    b = d.add(list(range(50, 90)))  # 3 blocks
    assert d.admit(a) and d.admit(b)
    c = d.add(list(range(200, 240)))
    assert not d.bm.can_allocate(c)  # 2 free blocks left: exhausted
    a_table = list(a.block_table)
    out = d.swap_out(a)
    assert [dev for dev, _ in out] == a_table and a.block_table == []
    assert d.bm.num_allocatable_blocks == 5 and d.admit(c)
    d.finish(b)
    d.drain()
    mapping = d.swap_in(a)
    (ev,) = [e for e in d.drain() if isinstance(e, p.SwapIn)]
    assert [h for h, _ in mapping] == [h for _, h in out]  # host blocks back in logical order
    assert a.block_table == [dev for _, dev in mapping] and a.host_table == []
    assert ev.mapping == mapping
    assert d.replay().snapshot() == d.snapshot()


def test_lru_evicts_the_least_recently_freed_cached_block_and_chain_tails_first():
    d = driver(num_device_blocks=6, block_size=4)
    old = d.add([1, 1, 1, 1, 2, 2, 2, 2, 9])  # 2 full blocks + 1
    new = d.add([3, 3, 3, 3, 4, 4, 4, 4, 9])
    d.admit(old)
    d.admit(new)
    d.finish(old)
    d.finish(new)
    d.drain()
    # the never-hashed blocks go first, then the LRU: old's tail, old's head, new's tail, ...
    big = d.add(list(range(50, 74)))  # 6 blocks: takes everything
    d.admit(big)
    evicted = [ev.block_id for ev in d.drain() if isinstance(ev, p.Evict)]
    assert len(evicted) == 4
    hashed_old = [ev for ev in d.events if isinstance(ev, p.Cached)][:2]
    hashed_new = [ev for ev in d.events if isinstance(ev, p.Cached)][2:4]
    assert evicted == [hashed_old[1].block_id, hashed_old[0].block_id,
                       hashed_new[1].block_id, hashed_new[0].block_id]


def test_a_hit_refreshes_a_cached_block_in_the_lru():
    d = driver(num_device_blocks=5, block_size=4)
    a = d.add([1] * 4 + [0])
    b = d.add([2] * 4 + [0])
    d.admit(a), d.admit(b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    d.finish(a), d.finish(b)
    again = d.add([1] * 4 + [5])  # hits a's block: it leaves the LRU and re-enters last
    d.admit(again)
    d.finish(again)
    d.drain()
    d.admit(d.add(list(range(10, 30))))  # 5 blocks: must evict both
    evicted = [ev.block_id for ev in d.drain() if isinstance(ev, p.Evict)]
    assert evicted == [b_block, a_block]


def test_a_prompt_shorter_than_one_block_never_hits():
    d = driver()
    short = [5, 6, 7]
    for _ in range(3):
        d.admit(d.add(short))
    assert "prefix_hit" not in kinds(d.drain())


def test_the_block_holding_the_last_prompt_token_is_never_reused():
    d = driver(block_size=4)
    d.admit(d.add([1, 2, 3, 4, 5, 6, 7, 8]))  # two full blocks, both cached
    d.drain()
    twin = d.add([1, 2, 3, 4, 5, 6, 7, 8])
    d.admit(twin)
    hits = [ev for ev in d.drain() if isinstance(ev, p.PrefixHit)]
    assert len(hits) == 1  # the second block holds the last token: computed again


def test_hash_collision_is_ruled_out_by_comparing_tokens():
    d = driver(block_size=4)
    a = d.add([1, 2, 3, 4, 0])
    d.admit(a)
    forged = d.add([9, 9, 9, 9, 0])
    forged.block_hashes = list(a.block_hashes[:1])  # pretend the hashes collide
    d.admit(forged)
    assert "prefix_hit" not in kinds(d.drain())


def test_prefix_caching_off_never_hashes():
    d = driver(enable_prefix_caching=False)
    for _ in range(2):
        d.admit(d.add(SYSTEM + [1]))
    assert not {"cached", "prefix_hit"} & set(kinds(d.drain()))


def test_clear_prefix_cache_evicts_every_unheld_cached_block_only():
    d = driver()
    held = d.add(SYSTEM + [1])
    gone = d.add(list(range(300, 340)))
    d.admit(held), d.admit(gone)
    d.finish(gone)
    d.drain()
    assert d.bm.clear_prefix_cache() == 2
    assert kinds(d.drain()) == ["evict", "evict"]
    assert d.bm.num_cached_blocks == 0 and all(d.bm.cache.hashes[b] for b in held.block_table[:3])


def test_free_releases_blocks_tail_first():
    d = driver()
    seq = d.add(list(range(40)))
    d.admit(seq)
    table = list(seq.block_table)
    d.drain()
    d.finish(seq)
    frees = [ev for ev in d.drain() if isinstance(ev, p.Free)]
    assert [ev.block_id for ev in frees] == table[::-1]
    assert kinds(d.events)[-1] == "finish"


def test_recompute_preemption_frees_everything_and_readmits_with_hits():
    d = driver()
    seq = d.add(SYSTEM + [1, 2])
    d.admit(seq)
    d.recompute(seq)
    assert seq.block_table == [] and seq.status is SeqStatus.WAITING
    d.drain()
    assert d.admit(seq)
    assert kinds(d.drain()).count("prefix_hit") == 3  # its own blocks were still cached
    assert d.replay().snapshot() == d.snapshot()


def test_out_of_blocks_raises_instead_of_corrupting():
    d = driver(num_device_blocks=2, block_size=4)
    seq = d.add([1, 2, 3, 4, 5, 6, 7, 8])
    d.admit(seq)
    with pytest.raises(NoFreeBlocks):
        d.bm.allocate(d.add([1]))


def test_watermark_keeps_headroom_for_running_sequences():
    d = driver(num_device_blocks=200)
    assert d.bm.watermark_blocks == 2
    assert not d.bm.can_allocate(d.add([0] * (199 * 16)))
    assert d.bm.can_allocate(d.add([0] * (198 * 16)))


def test_reset_rebuilds_pools_with_the_new_config():
    d = driver()
    d.admit(d.add(SYSTEM))
    d.seqs.clear()
    d.bm.reset(p.PoolConfig(block_size=8, num_device_blocks=10, num_host_blocks=2))
    state = d.replay()
    assert state.config.block_size == 8 and len(state.ref_counts) == 10 and not state.seqs
    assert state.snapshot() == d.snapshot()


def test_swap_in_takes_the_prefix_caches_copy_of_a_block_instead_of_copying_it_back():
    """Issue 28: a swapped-out sequence's prompt blocks stayed cached on the device; the swap-in
    copied them back into fresh blocks and evicted other cached blocks to make room. Now a host
    block copied from a cached block finds its content in the prefix cache again."""
    d = driver()
    seq = d.add(list(range(40)))  # 2 full blocks (cached) and a partial one
    d.admit(seq)
    d.decode(seq, 7)
    full = seq.block_table[:2]
    d.swap_out(seq)
    assert all(d.bm.pool.ref_counts[b] == 0 and b in d.bm.pool.evictable for b in full)  # cached, unheld
    d.drain()
    mapping = d.swap_in(seq)
    ev = d.drain()[-1]
    assert seq.block_table[:2] == full and [dev for _, dev in ev.shared] == full  # found again, not copied
    assert len(mapping) == 1 and mapping[0][1] == seq.block_table[2]  # only the partial block is copied
    assert not any(b in d.bm.pool.evictable for b in full)
    assert "2 already on the device (held, or found in the prefix cache), not copied" in words(ev)
    assert d.replay().snapshot() == d.snapshot()
    # once the cached copy is evicted, a swap-in copies the block back
    d.swap_out(seq)
    d.bm.clear_prefix_cache()
    d.drain()
    assert len(d.swap_in(seq)) == 3 and not d.drain()[-1].shared
    assert d.replay().snapshot() == d.snapshot()
