"""`make run-fleet`: two real vLLM servers (CPU, the bundled SmolLM2, small pools, the KVScope
plugin and ZMQ KV events on) and the dashboard on the fleet page, whose sidebar sends them a chat
workload round-robin or with prefix affinity.

    python -m tools.fleet_demo [--servers 2] [--num-blocks 96] [--port 8501] [--models smollm2,gemma3]

Both servers get the same PYTHONHASHSEED, so their block hashes agree as well as their content
(docs/fleet.md). The fleet file is written to a temporary folder and listed on start; the page
shows each server as connecting (retried with backoff) until its model is loaded, about a minute.
vLLM's own output comes out here, each line after its server's name. Stopping it (Ctrl-C, SIGTERM,
or the dashboard exiting) stops each server's whole process group, vLLM's engine core included.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from app.link.launcher import ServerProcess
from app.link.source import ROOT, VLLM_PYTHON
from app.streamlit_argv import streamlit_argv
from kvscope_contract.ready import free_ports


def start_server(name: str, model: str, num_blocks: int, ports: list[int]) -> tuple[ServerProcess, dict]:
    """One vLLM server; its output goes to ours, each line after its name."""
    api, ws, pub, replay = ports
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    proc = ServerProcess("integrations.vllm.serve", [model, "--port", str(api), "--kvscope-port", str(ws),
                                                     "--num-blocks", str(num_blocks),
                                                     "--", "--kv-events-config", json.dumps(events)],
                         str(VLLM_PYTHON), on_line=lambda line: print(f"[{name}] {line}", flush=True)).start()
    return proc, {"url": f"ws://127.0.0.1:{ws}", "api": f"http://127.0.0.1:{api}",
                  "kv_events": f"tcp://127.0.0.1:{pub}?replay=tcp://127.0.0.1:{replay}"}


def name_of(i: int) -> str:
    return f"vllm-{chr(97 + i)}"


def fleet_file(servers: list[dict], folder: Path) -> Path:
    path = folder / "fleet.toml"
    path.write_text("".join(f'[[engine]]\nname = "{name_of(i)}"\nurl = "{s["url"]}"\nkind = "vllm-plugin"\n'
                            f'api = "{s["api"]}"\n# KV events: {s["kv_events"]}\n\n' for i, s in enumerate(servers)))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=96, help="each server's pool, in blocks of 32 tokens")
    ap.add_argument("--port", type=int, default=8501, help="the dashboard's")
    ap.add_argument("--models", default="smollm2",
                    help="the servers' models, comma-separated, in turn: e.g. smollm2,gemma3 (a hybrid model, whose "
                         "six KV-cache groups each take a block of every prompt: give it --num-blocks 384)")
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        sys.exit("no .venv-vllm: `make vllm-venv` builds it (about 5 minutes)")
    os.environ.setdefault("PYTHONHASHSEED", "0")  # the same block hashes on every server
    # /reset_prefix_cache, for "Clear every prefix cache" and the routing lesson (the servers bind 127.0.0.1)
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    ports = free_ports(4 * args.servers)  # all at once: each distinct
    models = args.models.split(",")
    procs, servers = zip(*(start_server(name_of(i), models[i % len(models)], args.num_blocks, ports[4 * i:4 * i + 4])
                           for i in range(args.servers)))
    folder = Path(tempfile.mkdtemp(prefix="kvscope-fleet-"))
    path = fleet_file(list(servers), folder)
    print(f"[kvscope] {args.servers} vLLM servers starting (about a minute); fleet file {path}:\n{path.read_text()}",
          flush=True)
    print(f"[kvscope] the fleet page: http://localhost:{args.port}", flush=True)
    dash = subprocess.Popen(streamlit_argv(sys.executable, ["--fleet", str(path)], "--server.port", str(args.port)),
                            cwd=ROOT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stopped: clean up as on Ctrl-C
    try:
        return dash.wait()
    except KeyboardInterrupt:
        return 130
    finally:  # the dashboard too (a child of ours, not of the servers' log threads)
        if dash.poll() is None:
            dash.terminate()
            dash.wait(timeout=30)
        for proc in procs:
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
