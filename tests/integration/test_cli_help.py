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


def _descriptions() -> list[tuple[str, str]]:
    """(file, what its --help says first) for every module whose argparse description comes from
    its docstring's first line or paragraph: read from the source, nothing imported."""
    import ast
    import re
    out = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text()
        first = r"splitlines\(\)\[0\]|split\(\"\\n\"\)\[0\]"
        if not (m := re.search(rf"description=__doc__\.({first}|split\(\"\\n\\n\"\)\[0\])", text)):
            continue
        doc = ast.get_docstring(ast.parse(text), clean=False) or ""
        shown = doc.split("\n\n")[0] if "\\n\\n" in m.group(1) else doc.splitlines()[0]
        out.append((str(path.relative_to(ROOT)), " ".join(shown.split())))
    return out


def test_no_help_is_cut_mid_sentence():
    """Issue 28: `python -m engine.synthetic --help` said "... the real engine core (scheduler, block"."""
    found = _descriptions()
    assert len(found) > 10
    cut = [(f, d) for f, d in found if not d.endswith((".", ":", ")"))]
    assert not cut, cut
    out = subprocess.run([sys.executable, "-m", "engine.synthetic", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    said = " ".join(out.stdout.split("options:")[0].split("\n\n", 1)[1].split())
    assert said.startswith("A production-size pool") and said.endswith("."), said
