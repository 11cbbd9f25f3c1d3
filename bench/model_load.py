"""How long a model takes to load: in this process (torch imported, tokenizer and converted
weights already on disk), and in a fresh engine server process until it says it is ready (what
the dashboard's embedded engine waits for). Tiny and SmolLM2 interleaved over rounds.

    python -m bench.model_load [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

from bench.rounds import interleave, spread
from engine.model.model_loader import load_model
from app.link.launcher import ServerProcess

MODELS = ("tiny", "smollm2")


def in_process(spec: str) -> float:
    t0 = time.perf_counter()
    load_model(spec, device="cpu", progress=lambda _: None)
    return time.perf_counter() - t0


def server_ready(spec: str, *flags: str, timeout: float = 300) -> float:
    """Seconds from starting `python -m engine.serve.server --model SPEC FLAGS` as the dashboard
    starts its embedded engine (app/link/launcher.py) to its `ready: ws://` line."""
    proc = ServerProcess("engine.serve.server", ["--port", "0", "--model", spec, *flags]).start()
    try:
        if not proc.wait_ready(timeout):
            raise RuntimeError(f"the {spec} server did not get ready ({proc.exit_reason()}): "
                               + " | ".join(proc.tail(5)))
        return proc.ready_after
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
