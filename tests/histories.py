"""Event histories the view tests share: a small pool under pressure, driven by the real block
manager, and the view at one of its events."""
from __future__ import annotations

import random

from kvscope_contract import protocol as p
from app.link.client import View
from app.history.event_history import EventHistory
from tests.pool_driver import PoolDriver


PREFIX = list(range(100, 132))


def busy_history(seed: int = 7, ops: int = 1500, pool: p.PoolConfig | None = None) -> tuple[EventHistory, PoolDriver]:
    """A small pool under pressure, driven by the real block manager: prefix hits, forks,
    copies on write, swaps, recomputes, finishes (and, on a hybrid `pool`, windows that free
    blocks as they move); prompts carry their token texts; one operation per engine step."""
    rng = random.Random(seed)
    d = PoolDriver(pool or p.PoolConfig(block_size=4, num_device_blocks=48, num_host_blocks=16))
    h = EventHistory(d.first, checkpoint_every=50)
    for _ in range(ops):
        d.random_op(rng, [PREFIX], vocab=90)
        d.log.step += 1
        for ev in d.drain():
            h.append(ev)
    return h, d


def view_at(h: EventHistory, n: int) -> View:
    return View(h.at(n), n == h.last_event, 1, h.last_step_events(n))
