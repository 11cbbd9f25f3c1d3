"""A child server that cannot be started says so: no made-up exit signal, and for vLLM how to
get its virtualenv (walk of issue 17: `make run-vllm` without .venv-vllm read "stopped before it
was ready (killed by SIGHUP)")."""
from __future__ import annotations

from app.data.launcher import ServerProcess


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
