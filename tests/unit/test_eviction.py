"""Eviction policies (engine/core/eviction.py): each one's victim order, OPT's stale keys asked
again, loading by name or import path, and the BlockPool using one in place of its LRU."""
from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool
from engine.core.eviction import LFU, LRU, NEVER, OPT, load_policy, policy_name
from engine.core.events import EventLog
from engine.core.prefix_cache import PrefixCache


def drain(policy) -> list[int]:
    return [policy.pop() for _ in range(len(policy))]


def test_lru_is_least_recently_freed_first():
    lru = LRU()
    for b in (5, 1, 9, 3):
        lru.push(b)
    lru.remove(1)
    lru.push(1)  # freed again: now the most recent
    assert list(lru) == [5, 9, 3, 1] and 9 in lru and 7 not in lru
    assert drain(lru) == [5, 9, 3, 1]


def test_lfu_evicts_the_fewest_hits_then_the_least_recently_freed():
    lfu = LFU()
    for b, hits in ((1, 2), (2, 0), (3, 1), (4, 0)):
        for _ in range(hits):
            lfu.hit(b)
        lfu.push(b)
    lfu.remove(2)
    lfu.hit(2)
    lfu.push(2)  # one hit now, freed after 3: 3 goes first among the ones
    assert list(lfu) == [4, 3, 2, 1]
    assert drain(lfu) == [4, 3, 2, 1]
    lfu.push(1)  # evicted content: its count starts afresh
    lfu.push(5)
    assert drain(lfu) == [1, 5]


class Future:
    """Uses of each block by request index; the clock is the next request to be admitted."""

    def __init__(self, uses: dict[int, list[int]], depth: dict[int, int] | None = None):
        self.uses, self.depth, self.clock = uses, depth or {}, 0

    def now(self) -> float:
        return self.clock

    def next_use(self, cache, block: int) -> tuple[float, int]:
        later = [u for u in self.uses.get(block, []) if u >= self.clock]
        return (min(later) if later else NEVER), self.depth.get(block, 0)


def test_opt_evicts_the_farthest_next_use_never_used_first():
    future = Future({1: [3, 9], 2: [5], 3: [4], 4: []})
    opt = OPT()
    opt.bind(None, future)
    for b in (1, 2, 3, 4):
        opt.push(b)
    assert list(opt) == [4, 2, 3, 1]
    assert opt.pop() == 4 and opt.pop() == 2
    future.clock = 4  # request 3 came and did not revive block 1: its next use is 9 now
    assert list(opt) == [1, 3]
    assert drain(opt) == [1, 3]


def test_opt_breaks_ties_deepest_first_then_least_recently_freed():
    future = Future({1: [2], 2: [2], 3: [2], 4: [2]}, depth={1: 0, 2: 1, 3: 1, 4: 2})
    opt = OPT()
    opt.bind(None, future)
    for b in (1, 2, 3, 4):
        opt.push(b)
    assert drain(opt) == [4, 2, 3, 1]


def test_opt_needs_a_future():
    with pytest.raises(ValueError, match="trace replay"):
        OPT().bind(None, None)


def test_policies_by_name_and_by_import_path():
    assert load_policy("lru") is LRU and load_policy("lfu") is LFU and load_policy("opt") is OPT
    assert load_policy("engine.core.eviction:LFU") is LFU and policy_name("engine.core.eviction:LFU") == "LFU"
    for bad, words in (("mru", "say one of"), ("no.such.module:X", "no.such"), ("engine.core.eviction:Nope", "Nope"),
                       ("engine.core.eviction:NEVER", "lacks push")):
        with pytest.raises(ValueError, match=words):
            load_policy(bad)


def test_the_pool_evicts_by_its_policy():
    """Three cached blocks freed in order 0, 1, 2; block 0 hit twice, block 2 once: LRU takes 0
    first, LFU takes 1 (no hit)."""
    for policy, victim in ((LRU(), 0), (LFU(), 1)):
        cache = PrefixCache(3, 1, EventLog())
        pool = BlockPool(3, cache)
        pool.use(policy)
        blocks = [pool.take() for _ in range(3)]
        for i, b in enumerate(blocks):
            cache.register(b, 0, 100 + i, (i,), None, "s")
        for b in (0, 0, 2):
            pool.hold(b)
            pool.release(b)
        for b in blocks:
            pool.release(b)
        assert pool.num_allocatable == 3 and sorted(pool.evictable) == [0, 1, 2]
        assert pool.take() == victim and cache.hashes[victim] is None
    with pytest.raises(RuntimeError, match="before any block is cached"):
        pool.use(LRU())
