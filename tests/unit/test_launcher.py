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
