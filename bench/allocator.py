"""Block operations per second of the block manager, events on, over a synthetic trace.

10,000 requests of 16..2,048 tokens (a quarter of each generated), 30% of them starting with
one of five shared 256-token prefixes, run through admission (prefix lookup + allocate), one
decode slot per running sequence per step, and free. No model: this times the allocator.

Repeated `--rounds` times, each on a fresh block manager; prints medians and their spread.

    python -m bench.allocator [--requests 10000] [--block-size 16] [--blocks 8192] [--rounds 5]
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from bench.rounds import spread
from kvscope_contract import protocol as p
from engine.core.block_manager import BlockManager
from engine.core.events import EventLog
from engine.core.sequence import SamplingParams, Sequence


BLOCK_KINDS = {"alloc", "prefix_hit", "cow", "evict", "free", "cached"}


def make_trace(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(256)] for _ in range(5)]
    trace = []
    for _ in range(num_requests):
        total = rng.randint(16, 2048)
        out = max(1, total // 4)
        prompt = [rng.randrange(50_000) for _ in range(total - out)]
        if rng.random() < 0.3:
            prompt = (rng.choice(prefixes) + prompt)[:max(len(prompt), 1)]
        trace.append((prompt, out))
    return trace


def run(trace, block_size: int, num_blocks: int, max_running: int = 64) -> dict:
    log = EventLog()
    bm = BlockManager(p.PoolConfig(block_size=block_size, num_device_blocks=num_blocks), log)
    pending = list(reversed(trace))
    running: list[tuple[Sequence, int]] = []
    ops = Counter()
    num_events = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    while pending or running:
        while pending and len(running) < max_running:
            prompt, out = pending[-1]
            seq = Sequence(f"r{len(pending)}", "r", list(prompt), SamplingParams(max_tokens=out))
            if not bm.can_allocate(seq):
                break
            pending.pop()
            bm.allocate(seq)
            bm.cache_full_blocks(seq, len(seq))
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(1)
            log.emit(p.Append(seq_id=seq.seq_id, num_tokens=len(seq) - 1, token_ids=[1]))
            running.append((seq, out))
        still = []
        for seq, out in running:
            if seq.num_output_tokens >= out or not bm.can_append(seq):
                bm.free(seq)
                log.emit(p.Finish(seq_id=seq.seq_id, reason="length"))
                continue
            bm.append_slot(seq)
            ops["append_slot"] += 1
            bm.cache_full_blocks(seq, len(seq))
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(2)
            log.emit(p.Append(seq_id=seq.seq_id, num_tokens=len(seq) - 1, token_ids=[2]))
            still.append((seq, out))
        running = still
        events = log.drain()
        num_events += len(events)
        ops.update(ev.__struct_config__.tag for ev in events if ev.__struct_config__.tag in BLOCK_KINDS)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    total = sum(ops.values())
    return {"ops": dict(ops), "total_ops": total, "seconds": elapsed, "ops_per_s": total / elapsed,
            "ops_per_cpu_s": total / cpu, "events": num_events, "events_per_s": num_events / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    trace = make_trace(args.requests)
    runs = [run(trace, args.block_size, args.blocks) for _ in range(args.rounds)]
    r = runs[0]  # the trace is deterministic: every round does the same operations
    assert all(x["ops"] == r["ops"] for x in runs)
    changing = r["total_ops"] - r["ops"]["append_slot"]
    print(f"{args.requests} requests, block size {args.block_size}, {args.blocks} blocks, "
          f"{args.rounds} rounds; median (min..max)")
    print("block operations (the bench's own event counting is inside the timing): "
          + ", ".join(f"{k} {v:,}" for k, v in r["ops"].items()))
    print(f"{r['total_ops']:,} block ops in {spread([x['seconds'] for x in runs], '.2f')} s = "
          f"{spread([x['ops_per_s'] for x in runs], ',.0f')} ops/s; "
          f"{r['events']:,} events, {spread([x['events_per_s'] for x in runs], ',.0f')} events/s; "
          f"block-changing ops (all but append_slot): "
          f"{spread([changing / x['seconds'] for x in runs], ',.0f')}/s")
    print(f"per second of this process's CPU time (what other jobs on the machine change least): "
          f"{spread([x['ops_per_cpu_s'] for x in runs], ',.0f')} ops")


if __name__ == "__main__":
    main()
