"""How long a model takes to load: in this process (torch imported, tokenizer and converted
weights already on disk), and in a fresh engine server process until it says it is ready (what
the dashboard's embedded engine waits for). Tiny and SmolLM2 interleaved over rounds.

    python -m bench.model_load [--rounds 5]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.rounds import interleave, spread
from engine.model.model_loader import load_model
from kvscope_contract.ready import ready_url

MODELS = ("tiny", "smollm2")


def in_process(spec: str) -> float:
    t0 = time.perf_counter()
    load_model(spec, device="cpu", progress=lambda _: None)
    return time.perf_counter() - t0


def server_ready(spec: str) -> float:
    """Seconds from starting `python -m engine.serve.server` to its `ready: ws://` line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve.server", "--model", spec, "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:
            if ready_url(line):
                return time.perf_counter() - t0
        raise RuntimeError(f"the {spec} server exited before it was ready")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for spec in MODELS:  # the first load converts or caches what later loads reuse
        in_process(spec)
    loads = interleave({spec: (lambda s=spec: in_process(s)) for spec in MODELS}, args.rounds)
    ready = interleave({spec: (lambda s=spec: server_ready(s)) for spec in MODELS}, args.rounds)
    print(f"{args.rounds} rounds interleaved; seconds, median (min..max)")
    for spec in MODELS:
        print(f"{spec:8} load_model in this process {spread(loads[spec], '.2f')} s; "
              f"fresh server to ready {spread(ready[spec], '.2f')} s")


if __name__ == "__main__":
    main()
