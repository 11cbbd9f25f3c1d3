"""`make run-fleet` end to end (`python -m tools.fleet_demo`, what the target runs): two real vLLM
CPU servers and the dashboard, driven in Chromium as a user would: the load generator's chat
workload round-robin duplicates the system prompts' blocks across the two servers, *Clear every
prefix cache* empties both and says so, and the same workload with prefix affinity duplicates
none. Then vllm-b's API server is SIGKILLed: its card says why it is down, and Send goes to the one
engine left. Stopping the demo stops everything it started, the orphaned engine core included; its
log carries vLLM's own output and none of Streamlit's notes on fragments gone from the page. Its
own module: the two servers of test_vllm.py are gone by then (four vLLMs at once would crowd two
cores)."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path
import socket
import subprocess
import sys

import pytest

from tests.processes import alive, descendants
from tests.vllm.vllm_server import NO_VLLM, ROOT, VLLM_PYTHON
from kvscope_contract.ready import free_port
from tests.waiting import wait

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM)]

IDLE = """() => { const cards = [...document.querySelectorAll('[data-engine]')];
  return cards.length == 2 && cards.every(e => { const t = e.innerText;
    const c = /cached\\s*([\\d,]+)/.exec(t), r = /running \\/ waiting\\s*(\\d+) \\/ (\\d+)/.exec(t);
    return c && +c[1].replace(/,/g, '') > 0 && r && r[1] == '0' && r[2] == '0'; }); }"""
EMPTY = "() => [...document.querySelectorAll('[data-engine]')].every(e => /cached\\s*0\\b/.test(e.innerText))"
DUPLICATED = """(want) => [...document.querySelectorAll('[data-testid=stMetric]')].some(m => {
  const t = m.innerText.trim(); if (!t.startsWith('duplicated blocks')) return false;
  const n = +t.split('\\n').pop().replace(/,/g, ''); return want == 'some' ? n > 0 : n == 0; })"""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_make_run_fleet_round_robin_duplicates_and_affinity_does_not(tmp_path):
    from playwright.sync_api import sync_playwright
    from tools.launch import CHROMIUM, FLAGS

    port = free_port()
    log = (tmp_path / "demo.log").open("w")
    demo = subprocess.Popen([sys.executable, "-m", "tools.fleet_demo", "--port", str(port), "--num-blocks", "96"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: set[int] = set()
    try:
        wait(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 120, "the dashboard to listen")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}")
            page.wait_for_function("document.querySelectorAll('[data-engine] .st.live').length == 2", timeout=900_000)
            side = page.get_by_test_id("stSidebar")
            side.get_by_role("button", name="Send").click()  # 12 requests, 3 system prompts, round-robin
            page.wait_for_function(IDLE, timeout=600_000)
            page.wait_for_function(DUPLICATED, arg="some", timeout=30_000)
            assert "sent 12 of 12 requests round-robin to 2 engines" in side.inner_text()
            side.get_by_text("Hit rate since this Send").wait_for(timeout=10_000)
            side.get_by_role("button", name="Clear every prefix cache").click()
            page.wait_for_function(EMPTY, timeout=60_000)
            side.get_by_text("Clear every prefix cache: vllm-a emptied · vllm-b emptied").wait_for(timeout=30_000)
            side.get_by_text("affinity", exact=True).click()
            side.get_by_role("button", name="Send").click()
            page.wait_for_function(IDLE, timeout=600_000)
            page.wait_for_function(DUPLICATED, arg="none", timeout=30_000)
            assert "sent 12 of 12 requests affinity to 2 engines" in side.inner_text()
            # vllm-b's API server killed: its engine core (the plugin) says so and stops
            api = re.search(r'name = "vllm-b"\n(?:.*\n)*?api = "http://127\.0\.0\.1:(\d+)"',
                            (tmp_path / "demo.log").read_text()).group(1)
            server = next(pid for pid in descendants(demo.pid)
                          if f"--port\0{api}\0" in Path(f"/proc/{pid}/cmdline").read_text())
            tree = descendants(demo.pid)
            os.kill(server, signal.SIGKILL)
            page.wait_for_function("""() => { const e = document.querySelector('[data-engine="vllm-b"]');
                return e && e.querySelector('.st.down') && /API server \\(pid \\d+\\) died/.test(e.innerText); }""",
                                   timeout=60_000)
            side.get_by_role("button", name="Send").click()
            side.get_by_text("sent 12 of 12 requests affinity to 1 engine").wait_for(timeout=30_000)
            assert not errors, errors
            browser.close()
    finally:
        demo.send_signal(signal.SIGTERM)  # as `make` passes on a stop
        demo.wait(timeout=120)
        log.close()
        print((tmp_path / "demo.log").read_text()[-3000:])
    wait(lambda: not group_alive(demo.pid) and not any(alive(pid) for pid in tree), 60,
         "everything the demo started to be gone, the orphaned engine core too")
    text = (tmp_path / "demo.log").read_text()
    assert re.search(r"^\[vllm-a\] .*(INFO|WARNING)", text, re.M), "vLLM's own output in the log"
    assert "does not exist anymore" not in text
