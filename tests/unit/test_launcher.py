"""A child server that cannot be started says so: no made-up exit signal, and for vLLM how to
get its virtualenv (walk of issue 17: `make run-vllm` without .venv-vllm read "stopped before it
was ready (killed by SIGHUP)")."""
from __future__ import annotations

from pathlib import Path

from app.link.launcher import ServerProcess


def test_a_server_that_cannot_start_says_so(tmp_path):
    proc = ServerProcess("integrations.vllm.serve", ["smollm2"], python=str(tmp_path / ".venv-vllm" / "bin" / "python"))
    proc.start()
    assert proc.wait_handled(10) and proc.state == "exited" and proc.pid is None
    assert proc.exit_reason() == "it could not be started"
    lines = list(proc.tail(5))
    assert "No such file or directory" in lines[0] and "make vllm-venv" in lines[1], lines


def test_a_server_that_ran_and_exited_names_its_exit_code():
    proc = ServerProcess("engine.serve.replay", ["--help"]).start()  # exits at once, on its own
    assert proc.wait_handled(60)
    assert proc.exit_reason() == "exit code 0"


def test_ports_picked_together_are_distinct_and_free():
    """A fleet demo's vLLM once got one port for two of its servers: picked one at a time, the OS
    can hand a port out twice (2 in 2,000 draws of 8 here; 600 at a time would repeat one with
    99.8% odds over Linux's 28,000 ephemeral ports). Picked together, all differ, and each binds."""
    import socket

    from kvscope_contract.ready import free_ports

    ports = free_ports(600)
    assert len(set(ports)) == len(ports)
    socks = [socket.socket() for _ in ports]
    try:
        for sock, port in zip(socks, ports):
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in socks:
            sock.close()


SPAWNER = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(f"grandchild {child.pid}", flush=True)
time.sleep(300)
"""


def test_stopping_a_server_whose_process_was_killed_stops_what_it_started(tmp_path, monkeypatch):
    """vLLM's API server SIGKILLed leaves its engine core an orphan: stop() still ends it (the
    server's process group), and says lines of output as they come (make run-fleet prints vLLM's)."""
    import os
    import signal
    import time

    (tmp_path / "spawner.py").write_text(SPAWNER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    seen: list[str] = []
    proc = ServerProcess("spawner", [], on_line=seen.append).start()
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(seen[0].split()[1])
    os.kill(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    os.kill(grandchild, 0)  # an orphan now, still running
    proc.stop()
    assert proc.wait_handled(10)

    def state() -> str:  # "" once gone; "Z" for a zombie nobody reaps (a container without an init)
        try:
            return (Path("/proc") / str(grandchild) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return ""
    deadline = time.monotonic() + 10  # its output closes a moment before it has finished exiting
    while state() not in ("", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() in ("", "Z"), f"the orphan outlived stop() (state {state()})"
