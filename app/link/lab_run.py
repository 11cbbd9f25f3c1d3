"""The lab from the dashboard: `python -m engine.lab ... --json` in a child process (the dashboard
never imports the engine, which may run apart from it), its report back through the contract
(kvscope_contract/lab.py): a `LabReport` for a workload under several configs (`run_lab`), a
`TraceSweep` for a request trace at several capacities and policies (`run_sweep`). This session's
requests go to it as a recording."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabReport, TraceSweep, decode_report, decode_sweep
from app.link.launcher import IMPORT_ROOT, module_path

TIMEOUT_S = 300        # a workload under a few configs: seconds
SWEEP_TIMEOUT_S = 3600  # a whole production trace at a dozen capacities under three policies: minutes


def lab_child(args: list[str], timeout: float = TIMEOUT_S, progress: Callable[[str], None] | None = None) -> str:
    """Run `python -m engine.lab ARGS --json` and return what it printed, the JSON. Its stderr
    lines (a sweep's progress) go to `progress` as they come. A failure raises RuntimeError with
    its last line (the lab's own message, e.g. a trace's `file:line: rule`); a child running past
    `timeout` is killed and raises subprocess.TimeoutExpired."""
    argv = [sys.executable, "-m", module_path("engine.lab"), *args, "--json"]
    with tempfile.TemporaryFile() as out:  # not a pipe: a big report must not block the child while stderr is read
        proc = subprocess.Popen(argv, cwd=IMPORT_ROOT, stdout=out, stderr=subprocess.PIPE, text=True)
        late = threading.Event()
        timer = threading.Timer(timeout, lambda: (late.set(), proc.kill()))
        timer.start()
        last = ""
        try:
            for line in proc.stderr:
                if line.strip():
                    last = line.strip()
                    if progress is not None:
                        progress(last)
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # the caller gave up (an exception from `progress`)
                proc.kill()
                proc.wait()
            proc.stderr.close()
        if late.is_set():
            raise subprocess.TimeoutExpired(argv, timeout)
        if proc.returncode:
            raise RuntimeError(last or f"exit {proc.returncode}")
        out.seek(0)
        return out.read().decode()


def run_lab(workload: str, args: list[str]) -> LabReport:
    """Run `python -m engine.lab WORKLOAD ARGS --json`; raises RuntimeError with its message."""
    return decode_report(lab_child([workload, *args]))


def sweep_args(trace: Path | str, policies: list[str], capacities: list[int] | None = None, *,
               requests: int | None = None, block_size: int = 512, one_at_a_time: bool = False,
               model: str | None = None, bytes_per_token: int | None = None, host_blocks: int = 0) -> list[str]:
    """The command line of `python -m engine.lab trace:PATH` for these choices (docs/traces.md);
    `host_blocks`: each point also with a host tier of that many blocks (docs/offload.md)."""
    return ([f"trace:{trace}", "--policy", ",".join(policies)]
            + (["--sweep", ",".join(map(str, capacities))] if capacities else [])
            + (["--requests", str(requests)] if requests else [])
            + (["--block-size", str(block_size)] if block_size != 512 else [])
            + (["--one-at-a-time"] if one_at_a_time else [])
            + (["--model", model] if model else [])
            + (["--bytes-per-token", str(bytes_per_token)] if bytes_per_token else [])
            + (["--host-blocks", f"0,{host_blocks}"] if host_blocks else []))


def run_sweep(trace: Path | str, policies: list[str], capacities: list[int] | None = None, *,
              requests: int | None = None, block_size: int = 512, one_at_a_time: bool = False,
              model: str | None = None, bytes_per_token: int | None = None, host_blocks: int = 0,
              progress: Callable[[str], None] | None = None, timeout: float = SWEEP_TIMEOUT_S) -> TraceSweep:
    """Replay a request trace (the Mooncake format) at each capacity (blocks; None: the lab's
    log-spaced default) under each eviction policy: `python -m engine.lab trace:PATH ... --json`.
    `model` ("smollm2", "gemma3") or `bytes_per_token` sizes the capacities in bytes; `host_blocks`
    adds each point with a host tier of that size beside the device-only one. `progress`
    gets a line per replay ("lru at 1,000 blocks: hit rate 3.7% (0.4 s)"). Raises RuntimeError
    with the lab's message: a bad trace line names its file:line, nothing is run."""
    args = sweep_args(Path(trace).expanduser().absolute(), policies, capacities, requests=requests,
                      block_size=block_size, one_at_a_time=one_at_a_time, model=model,
                      bytes_per_token=bytes_per_token, host_blocks=host_blocks)
    return decode_sweep(lab_child(args, timeout, progress))


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
