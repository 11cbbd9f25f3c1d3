"""A trace's capacity sweep through the real allocator, timed: seconds per point, the whole
sweep, peak resident memory (docs/benchmarks.md, "Trace sweeps").

    python -m bench.trace_sweep          # the conversation trace, 512-token blocks, LRU, 12 points
    python -m bench.trace_sweep --trace synthetic --policy lru,lfu,opt --one-at-a-time --json out.json

Targets (issue 35): at most 60 s a point on 2 cores, a 12-point sweep in at most 5 minutes, at
most 2 GiB resident. The traces are read from $KVSCOPE_TRACES (default ../shared/traces/mooncake).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from kvscope_contract.lab import encode_sweep
from engine.lab import trace_sweep

TRACES = Path(os.environ.get("KVSCOPE_TRACES", Path(__file__).resolve().parents[2] / "shared/traces/mooncake"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conversation", help="conversation, synthetic, or a path")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--sweep", default=None, help="capacities in blocks (default: 12 log-spaced points)")
    ap.add_argument("--points", type=int, default=trace_sweep.POINTS)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--one-at-a-time", action="store_true")
    ap.add_argument("--json", type=Path, help="write the sweep as JSON")
    args = ap.parse_args(argv)
    path = Path(args.trace)
    if not path.is_file():
        path = TRACES / f"{args.trace}_trace.jsonl"
    caps = [int(x) for x in args.sweep.split(",")] if args.sweep else None
    if caps is None:
        index = trace_sweep.scan(path, args.block_size, args.requests)
        caps = trace_sweep.default_capacities(index, points=args.points)

    cpu = [time.process_time()]  # CPU seconds of this process: on a shared machine the steadier figure

    def progress(pt) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        now = time.process_time()
        cpu.append(now)
        print(f"{pt.policy:>4} {pt.blocks:>9,} blocks ({pt.tokens / 1e6:7.2f}M tokens): hit {pt.hit_rate:6.1%}  "
              f"{pt.seconds:6.1f} s wall, {cpu[-1] - cpu[-2]:6.1f} s CPU  peak RSS {rss:.2f} GiB", flush=True)

    t0 = time.perf_counter()
    s = trace_sweep.sweep(path, caps, args.policy.split(","), block_size=args.block_size, requests=args.requests,
                          one_at_a_time=args.one_at_a_time, bytes_per_token=327680, progress=progress)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    per = [b - a for a, b in zip(cpu, cpu[1:])]
    print(f"{path.name}: {s.requests:,} requests, {len(s.points)} points in {wall:.1f} s wall, "
          f"{time.process_time() - cpu[0]:.1f} s CPU (per point, CPU: max {max(per):.1f} s, mean "
          f"{sum(per) / len(per):.1f} s); ceiling {s.ceiling:.1%}; peak RSS {rss:.2f} GiB; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_bytes(encode_sweep(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
