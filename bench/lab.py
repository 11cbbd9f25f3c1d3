"""Workload tokens per second the lab simulates: the event-driven run against the step-by-step
one, on the presets (scaled up) and the demo recording, each under block sizes 8, 16 and 32 at
the same memory. Sides interleaved round by round; medians with their spread.

    python -m bench.lab [--rounds 3] [--scale 20]

Workload tokens: every request's prompt plus every sample's outputs; a run of N configs
simulates N times that. CPU time (this process) is given beside wall time: on a shared
machine it is the steadier of the two.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig
from engine.lab import report
from engine.lab.workload import Workload, from_recording, load

ROOT = Path(__file__).resolve().parent.parent
BASE = LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=1024, num_host_blocks=512))


def workloads(scale: int) -> list[Workload]:
    demo = from_recording(ROOT / "assets" / "demo_recording.jsonl")
    return [load("chat", scale), load("parallel", scale), load("mixed", 2 * scale), demo]


def timed(workload: Workload, cfgs: list[LabConfig], fast: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of running every config."""
    w0, c0 = time.perf_counter(), time.process_time()
    report.run(workload, cfgs, fast=fast)
    return time.perf_counter() - w0, time.process_time() - c0


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=int, default=20, help="preset repeats")
    args = ap.parse_args()
    cfgs = report.configs(BASE, block_sizes=[8, 16, 32])
    print(f"configs: {', '.join(c.label for c in cfgs)}; {args.rounds} rounds, sides interleaved\n")
    print("| workload | requests | tokens | fast: tokens/s wall | fast: tokens/s CPU | step by step: tokens/s CPU | "
          "speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    totals = {"fast": [0.0] * args.rounds, "slow": [0.0] * args.rounds}
    total_tokens = 0
    for w in workloads(args.scale):
        tokens = w.tokens * len(cfgs)
        total_tokens += tokens
        res = {"fast": [], "slow": []}
        for r in range(args.rounds):
            for side in (("fast", "slow") if r % 2 == 0 else ("slow", "fast")):
                res[side].append(timed(w, cfgs, side == "fast"))
                totals[side][r] += res[side][-1][1]
        fast_wall = [tokens / wall for wall, _ in res["fast"]]
        fast_cpu = [tokens / cpu for _, cpu in res["fast"]]
        slow_cpu = [tokens / cpu for _, cpu in res["slow"]]
        ratio = statistics.median(s[1] / f[1] for f, s in zip(res["fast"], res["slow"]))
        print(f"| {w.name} | {len(w.requests):,} | {tokens:,} | {spread(fast_wall)} | {spread(fast_cpu)} | "
              f"{spread(slow_cpu)} | {ratio:.1f}x |", flush=True)
    fast = [total_tokens / s for s in totals["fast"]]
    slow = [total_tokens / s for s in totals["slow"]]
    print(f"| **all four** | | {total_tokens:,} | | **{spread(fast)}** | {spread(slow)} | "
          f"{statistics.median(s / f for f, s in zip(totals['fast'], totals['slow'])):.1f}x |")


if __name__ == "__main__":
    main()
