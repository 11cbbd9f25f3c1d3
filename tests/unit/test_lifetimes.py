"""Block lifetimes from the event stream: a run small enough to follow by hand gives exactly
the lifetimes, idle times and reuse gaps its allocator decisions imply; windows select by step."""
from __future__ import annotations

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig
from kvscope_contract.state import PoolState
from engine.lab.sim import Lab
from engine.lab.workload import Request, Workload, load
from app.derived.lifetimes import Lifetimes

PROMPT = list(range(1, 9))  # two blocks of 4


def follow(workload: Workload, pool: p.PoolConfig) -> Lifetimes:
    lab = Lab(LabConfig(pool=pool), workload, keep_events=True)
    lt = Lifetimes.from_state(PoolState.from_snapshot(lab.snapshot()))
    lab.run(fast=False)
    for ev in lab.drain_events():
        lt.apply(ev)
    return lt


def test_a_run_followed_by_hand():
    # step 1: a allocates blocks 0 and 1 and caches them; b hits both (reuse gap 0: the same step),
    #         allocates 2, samples its one token and finishes: 2 stays cached, no holder
    # step 2: a's fifth token needs block 3; step 4: a finishes: 3 (never hashed) goes back to
    #         the free list (lifetime 4 - 2), 1 then 0 become cached with no holder
    # step 5: c needs three blocks: 3 from the free list, then the eviction queue's oldest, 2 and 1
    #         (both born at step 1; idle since steps 1 and 4)
    work = Workload("by hand", [Request("a", 0, PROMPT, [[100, 101, 102, 103]], 4),
                                Request("b", 0, PROMPT + [50, 51, 52, 53], [[200]], 1),
                                Request("c", 20, list(range(300, 312)), [[400]], 1)])
    lt = follow(work, p.PoolConfig(block_size=4, num_device_blocks=4))
    assert lt.samples == {"lifetime": [(4, 2), (5, 4), (5, 4)], "idle": [(5, 4), (5, 1)], "reuse": [(1, 0), (1, 0)]}
    assert lt.held["a"] == [(1, 2), (2, 3), (4, 0)]  # blocks a held at the end of each step it changed
    assert lt.values("lifetime", since=4).tolist() == [4, 4] and lt.values("lifetime", until=4).tolist() == [2]


def test_every_block_returned_to_the_free_list_has_one_lifetime():
    """With no prefix cache, every block allocated comes back freed: as many lifetimes as allocs,
    and their total is the block-steps the pool held (blocks in use summed over step ends)."""
    lab = Lab(LabConfig(pool=p.PoolConfig(block_size=8, num_device_blocks=64, enable_prefix_caching=False,
                                          num_host_blocks=64)), load("parallel", 2), keep_events=True)
    lt = Lifetimes.from_state(PoolState.from_snapshot(lab.snapshot()))
    row = lab.run(fast=False)
    events = lab.drain_events()
    for ev in events:
        lt.apply(ev)
    born = sum(1 for e in events if isinstance(e, (p.Alloc, p.Cow))) + sum(
        len(e.mapping) for e in events if isinstance(e, p.SwapIn))
    assert row.swap_outs > 0 and len(lt.samples["lifetime"]) == born and not lt.samples["idle"]
    # a block born and gone in the same step counts zero block-steps, as it does at step ends
    assert sum(lt.values("lifetime")) == round(row.mean_used * row.steps)


def test_on_a_hybrid_pool_a_window_free_ends_a_holding_like_a_free():
    """Gemma 3's six KV-cache groups, no prefix cache: a block a window frees goes back to the free
    list there and then (one lifetime each, as many as allocations, block-steps as the pool held
    them), and a request holds its blocks of every group."""
    from kvscope_contract.kv_groups import gemma3_groups
    pool = p.PoolConfig(block_size=8, num_device_blocks=400, enable_prefix_caching=False, num_host_blocks=64,
                        kv_groups=gemma3_groups(24))
    lab = Lab(LabConfig(pool=pool), load("chat"), keep_events=True)
    lt = Lifetimes.from_state(PoolState.from_snapshot(lab.snapshot()))
    state = PoolState.from_snapshot(lab.snapshot())
    row = lab.run(fast=False)
    events = lab.drain_events()
    held_by: dict[str, int] = {}
    for ev in events:
        lt.apply(ev)
        state.apply(ev)
        if isinstance(ev, p.StepDone):  # every group's blocks, a shared one once
            held_by = {}
            for s in state.seqs.values():
                held_by.setdefault(s.request_id, set()).update(b for t in s.block_tables for b in t if b >= 0)
            for rid, blocks in held_by.items():
                assert lt.held[rid][-1][1] == len(blocks)
    freed = sum(isinstance(e, p.WindowFree) and e.ref_count == 0 for e in events)
    born = sum(1 for e in events if isinstance(e, (p.Alloc, p.Cow))) + sum(
        len(e.mapping) for e in events if isinstance(e, p.SwapIn))
    assert freed > 100 and len(lt.samples["lifetime"]) == born and not lt.samples["idle"]
    assert sum(lt.values("lifetime")) == round(row.mean_used * row.steps)
