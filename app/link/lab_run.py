"""The lab from the dashboard: `python -m engine.lab ... --json` in a child process (the dashboard
never imports the engine, which may run apart from it), its report back through the contract
(kvscope_contract/lab.py); this session's requests go to it as a recording."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabReport, decode_report
from app.link.launcher import IMPORT_ROOT, module_path

TIMEOUT_S = 300


def run_lab(workload: str, args: list[str]) -> LabReport:
    """Run `python -m engine.lab WORKLOAD ARGS --json`; raises RuntimeError with its message."""
    proc = subprocess.run([sys.executable, "-m", module_path("engine.lab"), workload, *args, "--json"],
                          cwd=IMPORT_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return decode_report(proc.stdout)


def session_recording(client, folder: Path, upto: int | None = None, since: int | None = None) -> Path | None:
    """The requests this dashboard has seen (after event `since`, up to event `upto`), as a
    recording the lab can read, on the pool as it was at `since` (None: none yet)."""
    bounds = client.bounds()
    if bounds is None or client.hello is None:
        return None
    first, last = bounds
    last = last if upto is None else min(last, upto)
    first = first if since is None else max(first, min(since, last))
    start = client.view(first).mirror.state.snapshot()
    events = [e for e in client.events_before(last, last - first) if e.seq > first]
    if not any(isinstance(e, p.RequestAdded) for e in events):
        return None
    path = folder / "session.jsonl"
    with open(path, "wb") as f:
        for msg in (client.hello, start, p.Events(events=events)):
            f.write(p.encode(msg) + b"\n")
    return path
