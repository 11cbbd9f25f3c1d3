"""A recording in which the prefix cache misses for every reason (docs/misses.md), made by the real
scheduler and block manager (the lab, outputs replayed): a new prompt (cold, partial block), two
prompts that part inside a block (diverged), a prompt evicted by others before it comes again
(evicted), two long generations that preempt each other by recompute (recomputed), after two long
generations on a pool without prefix caching (caching off; one preempts the other) and a reset;
then a reset to a hybrid pool, a sliding window beside full attention (window). The dashboard's
browser test replays it."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from engine.lab import record
from engine.lab.sim import Lab
from engine.lab.workload import Request, Workload
from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig

POOL = p.PoolConfig(block_size=4, num_device_blocks=20, num_host_blocks=0, preemption_mode="recompute")


def _toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def requests() -> list[Request]:
    system, again = _toks(1, 6), _toks(2, 9)
    return [
        Request("new", 0, _toks(3, 10), [[5, 6]], 2),                           # cold 8, partial 2
        Request("sys-a", 0, system + _toks(4, 6), [[7]], 1),
        Request("sys-b", 1, system + _toks(5, 6), [[8]], 1),                    # diverged 2 in block 1
        Request("again-1", 2, again, [[9]], 1),
        *[Request(f"filler{i}", 3, _toks(10 + i, 40), [[1]], 1) for i in range(2)],  # the whole pool
        Request("again-2", 5, again, [[9]], 1),                                 # evicted 8
        *[Request(f"long{i}", 6, _toks(20 + i, 8), [_toks(30 + i, 40)], 40) for i in range(2)],  # recomputed
    ]


HYBRID = p.PoolConfig(block_size=4, num_device_blocks=40, kv_groups=[
    p.KVGroup(kind="sliding_window", sliding_window=9, layers=[0]), p.KVGroup(layers=[1])])


def hybrid_requests() -> list[Request]:
    """A long generation whose prompt blocks leave its window and are evicted from the sliding
    group by a filler; the prompt again hits only as far as the window still has a run."""
    prompt = list(range(200, 232))
    return [Request("hybrid-a", 0, prompt, [list(range(1, 41))], 40), Request("hybrid-filler", 16, [9] * 36, [[1]], 1),
            Request("hybrid-b", 18, prompt[:24] + [7], [[2]], 1)]                    # window 16


def write(path: Path) -> int:
    """Write the recording to `path`; returns the events written."""
    off = p.PoolConfig(block_size=4, num_device_blocks=20, enable_prefix_caching=False, preemption_mode="recompute")
    two = [Request(f"no-cache{i}", 0, _toks(40 + i, 10), [_toks(42 + i, 40)], 40) for i in range(2)]
    lab = Lab(LabConfig(pool=off), Workload("caching off", two), keep_events=True)  # caching off, and a preemption
    start = lab.snapshot()
    lab.run(fast=False)
    lab._reset_pools(POOL)
    after = lab.log.step
    lab.workload = Workload("every reason", [replace(r, arrival=r.arrival + after) for r in requests()])
    lab.run(fast=False)
    lab._reset_pools(HYBRID)  # a sliding window beside full attention: the window's blocks go first
    after = lab.log.step
    lab.workload = Workload("hybrid", [replace(r, arrival=r.arrival + after) for r in hybrid_requests()])
    lab.run(fast=False)
    return record.write(path, off, start, lab.log.drain())
