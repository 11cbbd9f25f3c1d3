"""What streaming events costs the engine, and how late they reach a client.

Runs the same workload through the engine server with 0 clients and with 2 clients reading
(each a separate process mirroring the pool with the reducer, as the dashboard does),
alternating the two a few times; prints the engine's output tokens/s for each and the ratio,
and the event-to-client latency (p50/p99) measured by the clients on the shared monotonic clock.

    python -m bench.events [--model smollm2] [--requests 16] [--new-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from engine.contract import protocol as p
from engine.contract.state import PoolState


def reader(url: str, t0: float) -> None:
    """Client process: mirror the pool, note each event's delay; print stats when the server goes."""
    from websockets.sync.client import connect

    step_lat, all_lat, state = [], [], None
    try:
        with connect(url, max_size=None) as ws:
            for frame in ws:
                now = time.monotonic()
                msg = p.decode_server_message(frame)
                if isinstance(msg, p.Snapshot):
                    state = PoolState.from_snapshot(msg)
                elif isinstance(msg, p.Events):
                    for ev in msg.events:
                        state.apply(ev)
                        delay = now - (t0 + ev.t)
                        all_lat.append(delay)
                        if isinstance(ev, p.StepDone):
                            step_lat.append(delay)
    except Exception:
        pass
    print(json.dumps({"step": step_lat, "all": all_lat}))


def run_once(engine, prompts, new_tokens: int, clients: int, nice: int = 0) -> tuple[float, list, list]:
    from engine.server import start_in_thread

    srv = start_in_thread(engine)
    readers = [subprocess.Popen([sys.executable, "-m", "bench.events", "--reader", srv.url,
                                 repr(engine.log.t0)], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.nice(nice))
               for _ in range(clients)]
    while len(srv.hub.clients) < clients:
        time.sleep(0.01)
    t_start = time.perf_counter()
    for prompt in prompts:
        srv.backend.commands.put(("command", p.Submit(prompt=prompt, max_tokens=new_tokens,
                                                          ignore_eos=True), None))
    while srv.backend.commands.qsize() or engine.has_unfinished():
        time.sleep(0.002)
    elapsed = time.perf_counter() - t_start
    srv.stop()
    step_lat, all_lat = [], []
    for r in readers:
        out = json.loads(r.communicate(timeout=60)[0])
        step_lat += out["step"]
        all_lat += out["all"]
    return len(prompts) * new_tokens / elapsed, step_lat, all_lat


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--reader":
        return reader(sys.argv[2], float(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nice", type=int, default=0, help="niceness of the client processes: on a 2-core "
                    "machine, 10 keeps their own CPU use from counting as the server's overhead")
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model))
    prompts = [f"Request {i}: explain paged attention in a few words." for i in range(args.requests)]
    run_once(engine, prompts[:2], 4, 0)  # warm up
    rates = {0: [], 2: []}
    lat_step, lat_all = [], []
    for _ in range(args.rounds):
        for clients in (0, 2):
            rate, s, a = run_once(engine, prompts, args.new_tokens, clients, args.nice)
            rates[clients].append(rate)
            lat_step += s
            lat_all += a
    r0, r2 = statistics.median(rates[0]), statistics.median(rates[2])
    print(f"{engine.loaded.name}, {args.requests} requests x {args.new_tokens} tokens, {args.rounds} rounds, "
          f"clients at nice {args.nice}")
    print(f"engine throughput: 0 clients {r0:.1f} tok/s, 2 clients {r2:.1f} tok/s: "
          f"{(1 - r2 / r0) * 100:+.1f}% loss (ratio {r2 / r0:.3f})")
    print(f"event-to-client latency, step events: p50 {pct(lat_step, .5):.2f} ms, p99 {pct(lat_step, .99):.2f} ms"
          f" (n={len(lat_step)}); all events (includes the rest of their step): p50 {pct(lat_all, .5):.2f} ms,"
          f" p99 {pct(lat_all, .99):.2f} ms")


if __name__ == "__main__":
    main()
