"""Record the offline demo: a real engine runs the dashboard's four scenarios, one after the
other, while the server records every message it sends.

    python -m tools.record_demo [--out assets/demo_recording.jsonl] [--model smollm2]

The engine is a separate process (`engine.serve.server --record`, started as the dashboard starts
it), driven over the protocol like the dashboard drives it; `streamlit run app/main.py -- --replay
FILE` or `python -m engine.serve.replay FILE` plays the result without torch.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.link.launcher import ServerProcess
from app.derived.scenarios import SCENARIOS
from app.link.wire import WireClient
from kvscope_contract import protocol as p


def start_engine(model: str, record: Path) -> ServerProcess:
    proc = ServerProcess("engine.serve.server",
                         ["--model", model, "--port", "0", "--record", str(record.resolve())]).start()
    ready = proc.wait_ready(900)
    print("\n".join(proc.lines), file=sys.stderr)
    if not ready:
        proc.stop()
        raise RuntimeError(f"the engine did not get ready: {proc.exit_reason()}")
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("assets/demo_recording.jsonl"))
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    args.out.unlink(missing_ok=True)
    proc = start_engine(args.model, args.out)
    try:
        wire = WireClient(proc.url)
        live: set[str] = set()

        def pump(until, timeout: float = 600) -> None:
            """Read until `until()` holds, following which sequences are live."""
            deadline = time.monotonic() + timeout
            while not until():
                msg = wire.read(timeout=max(0.1, deadline - time.monotonic()))
                if isinstance(msg, p.Events):
                    for ev in msg.events:
                        if isinstance(ev, (p.RequestAdded, p.Fork)):
                            live.add(ev.seq_id)
                        elif isinstance(ev, p.Finish):
                            live.discard(ev.seq_id)
                        elif isinstance(ev, p.Reset):
                            live.clear()
                elif isinstance(msg, p.Error):
                    raise RuntimeError(f"the engine refused a command: {msg.message}")

        kinds = wire.kinds
        pump(lambda: wire.state is not None)
        for run, scenario in enumerate(SCENARIOS, 1):
            print(f"scenario: {scenario.title}", file=sys.stderr)
            cmds = scenario.build(wire.state.config, run)
            added = kinds["request_added"] + sum(isinstance(c, p.Submit) for c in cmds)
            for cmd in cmds:
                wire.send(cmd)
                if isinstance(cmd, p.ResetCmd):
                    resets = kinds["reset"] + 1
                    pump(lambda: kinds["reset"] == resets
                         and wire.state.config.num_device_blocks == cmd.config.num_device_blocks)
            pump(lambda: kinds["request_added"] == added and not live)
        wire.close()
    finally:
        proc.stop()
    size = args.out.stat().st_size
    print(f"{args.out}: {size / 1e6:.2f} MB, " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
