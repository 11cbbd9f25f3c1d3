"""What streaming events costs the engine, and how late they reach a client.

Runs the same workload through the engine server with 0 clients and with 2 clients reading
(each a separate process mirroring the pool with the reducer, as the dashboard does),
interleaved over rounds; prints the engine's output tokens/s for each (median and spread), the
loss per round, the server process's CPU time per token (less swayed by other jobs on a shared
machine than the wall clock), the event-to-client latency (p50/p99) measured by the clients on the shared
monotonic clock, and what the Prometheus bookkeeping costs the engine thread per step.

    python -m bench.events [--model smollm2] [--requests 16] [--new-tokens 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from bench.rounds import interleave, ratios, spread
from kvscope_contract import protocol as p


def reader(url: str, t0: float) -> None:
    """Client process: mirror the pool, note each event's delay; print stats when the server goes."""
    from app.link.wire import WireClient

    step_lat, all_lat = [], []
    try:
        for msg in WireClient(url):  # each message mirrored as the dashboard mirrors it
            now = time.monotonic()
            if isinstance(msg, p.Events):
                for ev in msg.events:
                    delay = now - (t0 + ev.t)
                    all_lat.append(delay)
                    if isinstance(ev, p.StepDone):
                        step_lat.append(delay)
    except Exception:
        pass
    print(json.dumps({"step": step_lat, "all": all_lat}))


def run_once(engine, prompts, new_tokens: int, clients: int, nice: int = 0
             ) -> tuple[float, float, list, list]:
    """(tokens/s, this process's CPU ms per token, step-event delays, all event delays)."""
    from engine.serve.server import start_in_thread

    srv = start_in_thread(engine)
    readers = [subprocess.Popen([sys.executable, "-m", "bench.events", "--reader", srv.url,
                                 repr(engine.log.t0)], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.nice(nice))
               for _ in range(clients)]
    while len(srv.hub.clients) < clients:
        time.sleep(0.01)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    for prompt in prompts:
        srv.backend.commands.put(("command", p.Submit(prompt=prompt, max_tokens=new_tokens,
                                                          ignore_eos=True), None))
    while srv.backend.commands.qsize() or engine.has_unfinished():
        time.sleep(0.002)
    elapsed, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
    srv.stop()
    step_lat, all_lat = [], []
    for r in readers:
        out = json.loads(r.communicate(timeout=60)[0])
        step_lat += out["step"]
        all_lat += out["all"]
    tokens = len(prompts) * new_tokens
    return tokens / elapsed, cpu * 1000 / tokens, step_lat, all_lat


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def metrics_cost(engine, prompts, new_tokens: int, rounds: int) -> tuple[list[float], list[float], float]:
    """What the server's Prometheus bookkeeping costs the engine thread: the same workload run
    step by step, its event batches then fed to a fresh EngineMetrics `rounds` times. Returns
    the microseconds per step of each feed, its share of the engine's step time, and one scrape's ms."""
    from engine.serve.metrics import EngineMetrics
    from engine.core.sequence import SamplingParams

    start = engine.snapshot()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    batches = [engine.drain_events()]

    def steps() -> None:
        while engine.has_unfinished():
            engine.step()
            batches.append(engine.drain_events())

    # on its own thread, as in the server: torch's OpenMP team of the main thread runs many
    # times slower when other jobs crowd the cores
    worker = threading.Thread(target=steps)
    worker.start()
    worker.join()
    step_ms = sum(ev.duration_ms for b in batches for ev in b if isinstance(ev, p.StepDone))
    per_step, share = [], []
    for _ in range(rounds):
        metrics = EngineMetrics(engine.loaded.name, lambda: start)
        t0 = time.perf_counter()
        for batch in batches:
            metrics.observe(batch)
        took = time.perf_counter() - t0
        per_step.append(took / (len(batches) - 1) * 1e6)
        share.append(took * 1000 / step_ms * 100)
    scrapes = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        metrics.render()
        scrapes.append((time.perf_counter() - t0) * 1000)
    return per_step, share, statistics.median(scrapes)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--reader":
        return reader(sys.argv[2], float(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nice", type=int, default=0, help="niceness of the client processes: on a 2-core "
                    "machine, 10 keeps their own CPU use from counting as the server's overhead")
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.model.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model))
    prompts = [f"Request {i}: explain paged attention in a few words." for i in range(args.requests)]
    run_once(engine, prompts[:2], 4, 0)  # warm up
    lat_step, lat_all = [], []

    def side(clients: int):
        def run() -> tuple[float, float]:
            rate, cpu, s, a = run_once(engine, prompts, args.new_tokens, clients, args.nice)
            lat_step.extend(s)
            lat_all.extend(a)
            return round(rate, 1), round(cpu, 3)
        return run

    runs = interleave({"0 clients": side(0), "2 clients": side(2)}, args.rounds, say=print)
    rates = {k: [r for r, _ in v] for k, v in runs.items()}
    cpu = {k: [c for _, c in v] for k, v in runs.items()}
    loss = [(1 - r) * 100 for r in ratios(rates["0 clients"], rates["2 clients"])]
    extra = [(r - 1) * 100 for r in ratios(cpu["0 clients"], cpu["2 clients"])]
    per_step, share, scrape_ms = metrics_cost(engine, prompts, args.new_tokens, args.rounds)
    print(f"{engine.loaded.name}, {args.requests} requests x {args.new_tokens} tokens, {args.rounds} rounds "
          f"interleaved, clients at nice {args.nice}; median (min..max)")
    print(f"engine throughput: 0 clients {spread(rates['0 clients'])} tok/s, "
          f"2 clients {spread(rates['2 clients'])} tok/s; loss per round {spread(loss)}%")
    print(f"server process CPU per token (engine, torch and hub threads; the readers are other processes): "
          f"0 clients {spread(cpu['0 clients'], '.2f')} ms, 2 clients {spread(cpu['2 clients'], '.2f')} ms; "
          f"extra per round {spread(extra)}%")
    print(f"event-to-client latency, step events: p50 {pct(lat_step, .5):.2f} ms, p99 {pct(lat_step, .99):.2f} ms"
          f" (n={len(lat_step)}); all events (includes the rest of their step): p50 {pct(lat_all, .5):.2f} ms,"
          f" p99 {pct(lat_all, .99):.2f} ms")
    print(f"metrics bookkeeping on the engine thread: {spread(per_step)} us per step, "
          f"{spread(share, '.3f')}% of the step time; one scrape {scrape_ms:.1f} ms (scraper's thread)")


if __name__ == "__main__":
    main()
