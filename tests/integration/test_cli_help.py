"""Every console script of pyproject.toml answers --help with its usage and exits 0, starting
nothing (issue 17, item 4: `kvscope --help` started a dashboard on :8501 instead)."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_answers_help_and_exits(script):
    exe = Path(sys.executable).parent / script
    assert exe.exists(), f"{exe} is missing: `make install` installs the project's console scripts"
    # a server would not exit: the timeout is the proof that nothing was started
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: {script}"), out.stdout[:500]
    assert "--help" in out.stdout and len(out.stdout.splitlines()) > 3
    assert "Local URL" not in out.stdout + out.stderr  # Streamlit's banner: a server started


def test_the_dashboards_help_names_its_sources_and_where_other_flags_go():
    out = subprocess.run([str(Path(sys.executable).parent / "kvscope"), "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    for flag in ("--engine", "--replay", "--vllm", "--kv-events", "kvscope-engine --help", "STREAMLIT_SERVER_PORT"):
        assert flag in out.stdout, flag
