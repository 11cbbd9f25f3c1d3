"""Record the offline demo: a real engine runs the dashboard's four scenarios, one after the
other, while the server records every message it sends.

    python -m tools.record_demo [--out assets/demo_recording.jsonl] [--model smollm2]

The engine is a separate process (`engine.serve.server --record`), driven over the protocol like the
dashboard drives it; `streamlit run app/main.py -- --replay FILE` or `python -m engine.serve.replay
FILE` plays the result without torch.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from websockets.sync.client import connect

from app.data.scenarios import SCENARIOS
from kvscope_contract import protocol as p
from kvscope_contract.ready import ready_url


def start_engine(model: str, record: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve.server", "--model", model, "--port", "0",
                             "--record", str(record)], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        print(line, end="", file=sys.stderr)
        if url := ready_url(line):
            return proc, url
    raise RuntimeError(f"the engine exited with {proc.wait()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("assets/demo_recording.jsonl"))
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    args.out.unlink(missing_ok=True)
    proc, url = start_engine(args.model, args.out)
    kinds: Counter = Counter()
    live: set[str] = set()
    config = None
    try:
        with connect(url, max_size=None) as ws:
            def pump(until, timeout: float = 600) -> None:
                nonlocal config
                deadline = time.monotonic() + timeout
                while not until():
                    msg = p.decode_server_message(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
                    if isinstance(msg, (p.Hello, p.Snapshot)):
                        config = msg.config
                    elif isinstance(msg, p.Events):
                        for ev in msg.events:
                            kinds[ev.__struct_config__.tag] += 1
                            if isinstance(ev, (p.RequestAdded, p.Fork)):
                                live.add(ev.seq_id)
                            elif isinstance(ev, p.Finish):
                                live.discard(ev.seq_id)
                            elif isinstance(ev, p.Reset):
                                live.clear()
                    elif isinstance(msg, p.Error):
                        raise RuntimeError(f"the engine refused a command: {msg.message}")

            pump(lambda: config is not None)
            for run, scenario in enumerate(SCENARIOS, 1):
                print(f"scenario: {scenario.title}", file=sys.stderr)
                cmds = scenario.build(config, run)
                added = kinds["request_added"] + sum(isinstance(c, p.Submit) for c in cmds)
                for cmd in cmds:
                    ws.send(p.encode(cmd).decode())
                    if isinstance(cmd, p.ResetCmd):
                        resets = kinds["reset"] + 1
                        pump(lambda: kinds["reset"] == resets and config.num_device_blocks == cmd.config.num_device_blocks)
                pump(lambda: kinds["request_added"] == added and not live)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    size = args.out.stat().st_size
    print(f"{args.out}: {size / 1e6:.2f} MB, " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
