"""A trace played live at production size, timed: the player behind the real server, the
dashboard's own client attached over the WebSocket (docs/benchmarks.md, "Trace sweeps").

    python -m bench.trace_play                     # conversation, first 300 requests, 1,048,576 blocks of 16, LRU
    python -m bench.trace_play --trace synthetic --requests 1000 --policy opt

Prints the steps and events, the wall and CPU time, whether the client resynced, its hit rate
beside the player's (equal when it saw every event), and the peak resident memory of the three.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from app.link.client import EngineClient
from bench.trace_sweep import TRACES
from engine.lab.trace_play import TracePlayer, player_hub
from engine.serve.hub import serve_in_thread


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conversation", help="conversation, synthetic, or a path")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--policy", default="lru")
    args = ap.parse_args(argv)
    path = Path(args.trace) if args.trace.endswith(".jsonl") else TRACES / f"{args.trace}_trace.jsonl"
    player = TracePlayer(path, args.blocks, args.policy, block_size=args.block_size, requests=args.requests)
    srv = serve_in_thread(player_hub(player))
    client = EngineClient(srv.url)
    t0 = time.monotonic()
    while client.bounds() is None or player.has_unfinished() or client.bounds()[1] < player.log.seq:
        time.sleep(0.1)
    wall = time.monotonic() - t0
    tally, meter = client.view().mirror.tally, player.meter.counts
    print(f"{path.name}, {player.index.requests} requests, {args.blocks:,} blocks of {args.block_size}, "
          f"{args.policy}: {player.log.step:,} steps, {player.log.seq:,} events in {wall:.1f} s "
          f"({time.process_time():.1f} s CPU); client hit {tally.hit_tokens:,} of {tally.looked_up_tokens:,}, "
          f"player {meter.hit_tokens:,} of {meter.looked_up_tokens:,}; resyncs {client.status.resyncs}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    client.close()
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
