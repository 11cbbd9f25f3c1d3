"""What a Prometheus scrape of the engine server costs as the pool grows (no model).

Pools filled to 75% by the real block manager with sequences of 16..4,096 tokens; their events
fed to EngineMetrics (the engine thread's share), then scraped `--rounds` times (the scraper's
thread: a copy of the mirror under the lock, then the gauges from the copy).

    python -m bench.metrics [--rounds 5]
"""
from __future__ import annotations

import argparse
import random
import time

from bench.rounds import spread
from engine.core.block_manager import BlockManager
from kvscope_contract import protocol as p
from engine.core.events import EventLog
from engine.serve.metrics import EngineMetrics
from engine.core.sequence import Sequence

POOLS = (1024, 8192, 65536)
FILL = 0.75


def filled(num_blocks: int) -> tuple[EngineMetrics, list[p.Event]]:
    log, rng = EventLog(), random.Random(0)
    bm = BlockManager(p.PoolConfig(num_device_blocks=num_blocks, num_host_blocks=0), log)
    start = bm.state([]).snapshot()
    live = []
    while bm.num_allocatable_blocks > num_blocks * (1 - FILL):
        sid = f"s{len(live)}"
        seq = Sequence(sid, sid, [rng.randrange(50_000) for _ in range(rng.randint(16, 4096))])
        log.emit(p.RequestAdded(request_id=sid, seq_id=sid, prompt_tokens=len(seq)))
        bm.allocate(seq)
        bm.cache_full_blocks(seq, len(seq))
        log.emit(p.StatusChange(seq_id=sid, status="running"))
        log.emit(p.Append(seq_id=sid, num_tokens=len(seq)))
        live.append(seq)
    return EngineMetrics("bench", lambda: start), log.drain()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"pools {FILL:.0%} used, {args.rounds} rounds; median (min..max)")
    for n in POOLS:
        observe, scrape = [], []
        for _ in range(args.rounds):
            metrics, events = filled(n)
            t0 = time.perf_counter()
            metrics.observe(events)
            observe.append((time.perf_counter() - t0) / len(events) * 1e6)
            t0 = time.perf_counter()
            metrics.render()
            scrape.append((time.perf_counter() - t0) * 1000)
        print(f"{n:>6,} blocks, {len(events):>6,} events: observe {spread(observe, '.2f')} us per event "
              f"(engine thread); scrape {spread(scrape)} ms (scraper's thread)")


if __name__ == "__main__":
    main()
