"""vLLM's inter-token latency with dashboards reconnecting to the KVScope plugin in a loop, against
none (issue 37: a client that reconnects must not stall vLLM's steps).

Starts a real `vllm serve` with the plugin (integrations.vllm.serve, vLLM's virtualenv), then runs
rounds that alternate (quiet, churn, churn, quiet, ...): in each, STREAMS streaming completions
at once, every chunk's arrival timed (one token a chunk); in a churn round four clients connect
to the plugin, read its hello and snapshot, close and connect again, all the round long. It
prints each side's median p99 and median inter-token latency, their spread over rounds, and the
median of the rounds' p99 ratios (churn / quiet, the two runs of a round being closest in time).

    .venv/bin/python -m bench.vllm_reconnect [--rounds 6] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from app.link.source import ROOT, VLLM_PYTHON
from kvscope_contract.ready import free_ports, ready_url

STREAMS, CHURNERS = 4, 4


def start(num_blocks: int) -> tuple[subprocess.Popen, str, str]:
    api_port, ws_port = free_ports(2)
    proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "integrations.vllm.serve", "smollm2", "--port", str(api_port),
                             "--kvscope-port", str(ws_port), "--num-blocks", str(num_blocks)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ws = ""
    for line in proc.stdout:
        if url := ready_url(line):
            ws = url
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    api = f"http://127.0.0.1:{api_port}"
    while True:
        try:
            with urllib.request.urlopen(api + "/health", timeout=2):
                return proc, api, ws
        except OSError:
            if proc.poll() is not None:
                sys.exit("vLLM stopped while starting")
            time.sleep(0.5)


def stream(api: str, prompt: str, tokens: int, gaps: list[float]) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "temperature": 0.0}
    req = urllib.request.Request(api + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    last = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def churn(ws: str, stop: threading.Event, count: list[int]) -> None:
    from websockets.sync.client import connect

    while not stop.is_set():
        try:
            with connect(ws, max_size=None, open_timeout=10) as c:
                c.recv(timeout=30)  # hello
                c.recv(timeout=30)  # snapshot
            count[0] += 1
        except Exception:
            time.sleep(0.05)


def one_round(api: str, ws: str, tokens: int, churning: bool, i: int) -> tuple[list[float], int]:
    gaps: list[float] = []
    stop, count = threading.Event(), [0]
    churners = [threading.Thread(target=churn, args=(ws, stop, count), daemon=True)
                for _ in range(CHURNERS if churning else 0)]
    for t in churners:
        t.start()
    streams = [threading.Thread(target=stream, args=(api, f"Round {i}, story {k}: once upon a time", tokens, gaps))
               for k in range(STREAMS)]
    for t in streams:
        t.start()
    for t in streams:
        t.join()
    stop.set()
    for t in churners:
        t.join()
    return gaps, count[0]


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per side")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--num-blocks", type=int, default=256)
    args = ap.parse_args()
    proc, api, ws = start(args.num_blocks)
    try:
        one_round(api, ws, 8, True, -1)  # warm up both paths
        tails: dict[str, list[float]] = {"quiet": [], "churn": []}
        medians: dict[str, list[float]] = {"quiet": [], "churn": []}
        for i in range(args.rounds):
            for side in (("quiet", "churn") if i % 2 == 0 else ("churn", "quiet")):
                gaps, connects = one_round(api, ws, args.tokens, side == "churn", i)
                tails[side].append(p99(gaps))
                medians[side].append(statistics.median(gaps))
                print(f"round {i + 1} {side:5s}: ITL p99 {1000 * tails[side][-1]:6.1f} ms, median "
                      f"{1000 * medians[side][-1]:5.1f} ms over {len(gaps)} gaps"
                      + (f", {connects} reconnects" if side == "churn" else ""), flush=True)
        for side in tails:
            t = tails[side]
            print(f"{side:5s}: ITL p99 median {1000 * statistics.median(t):.1f} ms (spread {1000 * min(t):.1f}.."
                  f"{1000 * max(t):.1f}), median ITL {1000 * statistics.median(medians[side]):.1f} ms")
        ratio = statistics.median(c / q for c, q in zip(tails["churn"], tails["quiet"]))
        print(f"four clients reconnecting in a loop: ITL p99 x{ratio:.3f} of none (median of the rounds' ratios)")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
