"""Where the dashboard's events come from: an embedded engine (the default), a running engine
to attach to, a recording to replay, a vLLM it starts with the KVScope plugin, or the ZMQ
KV-event stream of a vLLM / SGLang / TensorRT-LLM server.

    streamlit run app/main.py                                  # embedded engine, bundled model
    streamlit run app/main.py -- --model tiny --num-device-blocks 1024   # other flags go to the engine
    streamlit run app/main.py -- --engine ws://HOST:PORT [--token T]
    streamlit run app/main.py -- --replay assets/demo_recording.jsonl [--speed 2]
    streamlit run app/main.py -- --vllm [MODEL] [--num-blocks 128]      # other flags go to vllm serve
    streamlit run app/main.py -- --kv-events tcp://HOST:5557[?topic=T&replay=tcp://HOST:5558] [--tokenizer DIR]
    streamlit run app/main.py -- --fleet fleet.toml                    # many engines side by side (docs/fleet.md)
    streamlit run app/main.py -- --trace TRACE.jsonl [--blocks 1048576 --block-size 16 --policy lru ...]
                                                    # play a request trace in the pool (docs/traces.md)

The same settings can come from the environment (KVSCOPE_ENGINE, KVSCOPE_TOKEN,
KVSCOPE_REPLAY, KVSCOPE_MODEL, KVSCOPE_VLLM, KVSCOPE_KV_EVENTS, KVSCOPE_TOKENIZER, KVSCOPE_FLEET,
KVSCOPE_TRACE), which is how
the tests choose.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"  # the grid's and scrubber's JS and CSS, the bundled recordings (in the wheel too)
# vLLM's own virtualenv (`make vllm-venv`); KVSCOPE_VLLM_VENV names another (the Makefile's
# VLLM_VENV, e.g. .venv-vllm-0.27.1 for another release)
VLLM_PYTHON = (ROOT / os.environ.get("KVSCOPE_VLLM_VENV", ".venv-vllm")) / "bin" / "python"


@dataclass(frozen=True)
class Source:
    kind: Literal["embedded", "attach", "replay", "vllm", "kv_events", "fleet", "trace"] = "embedded"
    url: str = ""                       # attach, kv_events
    token: str = ""                     # attach
    path: str = ""                      # replay; fleet: its fleet file ("": an empty fleet); trace: the trace
    speed: float = 1.0                  # replay
    model: str = "smollm2"              # embedded; fleet: the engines a fleet lesson starts
    engine_args: tuple[str, ...] = ()  # embedded: further engine.serve.server flags; vllm: serve's; trace: player's
    tokenizer: str = ""                 # kv_events: a folder with tokenizer.json, for block text

    @property
    def label(self) -> str:
        if self.kind == "attach":
            return "attached engine"
        if self.kind == "replay":
            return f"replay of {Path(self.path).name}"
        if self.kind == "vllm":
            return f"vLLM ({Path(self.model).name}) with the KVScope plugin"
        if self.kind == "kv_events":
            return f"KV events from {self.url}"
        if self.kind == "fleet":
            return f"fleet of {Path(self.path).name}" if self.path else "fleet"
        if self.kind == "trace":
            return f"trace replay of {Path(self.path).name}"
        return f"embedded engine ({self.model})"

    def trace_option(self, flag: str, default: str) -> str:
        """A trace source's player flag (`--blocks`, `--policy`, ...), as given or its default."""
        args = list(self.engine_args)
        return args[args.index(flag) + 1] if flag in args[:-1] else default

    def server_args(self) -> tuple[str, tuple[str, ...]]:
        """The module and flags of the child server an embedded, replay or vLLM source runs."""
        if self.kind == "replay":
            return "engine.serve.replay", (self.path, "--port", "0", "--loop", "--speed", f"{self.speed:g}")
        if self.kind == "vllm":
            return "integrations.vllm.serve", (self.model, "--port", "0", "--kvscope-port", "0", *self.engine_args)
        if self.kind == "trace":
            return "engine.lab.trace_play", (self.path, "--port", "0", *self.engine_args)
        return "engine.serve.server", ("--model", self.model, "--port", "0", *self.engine_args)


def python_for(module: str) -> str:
    """The Python a child server runs with: vLLM's own virtualenv for vLLM (make vllm-venv)."""
    return str(VLLM_PYTHON) if module.startswith("integrations.vllm") else sys.executable


def recordings() -> list[Path]:
    """Recordings offered by the replay picker: those bundled in assets/."""
    return sorted(ASSETS.glob("*.jsonl"))


def recording_path(given: str | Path) -> Path:
    """A recording by its path, or by the name of one bundled in assets/ (`demo_recording.jsonl`
    from any folder: with pip, the bundled ones live in the installed package)."""
    path = Path(given).expanduser()
    bundled = ASSETS / path.name
    return bundled if not path.exists() and bundled.exists() else path


def is_bundled(path: Path) -> bool:
    return path.resolve().parent == ASSETS.resolve()


EPILOG = """Any other flag goes to the embedded engine (kvscope-engine --help lists them: --model,
--num-device-blocks, --num-host-blocks, --block-size, ...) or, with --vllm, to `vllm serve`.
Streamlit's own options come from the environment, e.g. STREAMLIT_SERVER_PORT=8502 kvscope."""


def parser(env: dict[str, str] | None = None, prog: str = "streamlit run app/main.py --") -> argparse.ArgumentParser:
    """The dashboard's own flags (defaults from the environment)."""
    env = os.environ if env is None else env
    ap = argparse.ArgumentParser(prog=prog, allow_abbrev=False, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="KVScope's dashboard: a paged KV cache, live, at http://localhost:8501.\n"
                                             "Without a source flag it starts an embedded engine on the bundled model.")
    ap.add_argument("--engine", default=env.get("KVSCOPE_ENGINE", ""), help="attach to ws://HOST:PORT")
    ap.add_argument("--token", default=env.get("KVSCOPE_TOKEN", ""),
                    help="with --engine: the token it was started with")
    ap.add_argument("--replay", default=env.get("KVSCOPE_REPLAY", ""), help="replay a recording")
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed")
    ap.add_argument("--model", default=env.get("KVSCOPE_MODEL", "smollm2"), help="embedded engine's model")
    ap.add_argument("--vllm", nargs="?", const="smollm2", default=env.get("KVSCOPE_VLLM"),
                    help="start vLLM (from .venv-vllm) with the KVScope plugin on MODEL: a folder, smollm2 "
                         "(the default) or gemma3 (the bundled hybrid Gemma 3)")
    ap.add_argument("--kv-events", default=env.get("KVSCOPE_KV_EVENTS", ""),
                    help="subscribe to a ZMQ KV-event stream: tcp://HOST:5557[?topic=T&replay=tcp://HOST:5558]")
    ap.add_argument("--tokenizer", default=env.get("KVSCOPE_TOKENIZER", ""),
                    help="with --kv-events: a folder with tokenizer.json, for block text")
    ap.add_argument("--trace", default=env.get("KVSCOPE_TRACE", ""),
                    help="play a request trace in the pool (other flags go to python -m engine.lab.trace_play: "
                         "--blocks, --block-size, --policy, --requests, --step-delay-ms)")
    ap.add_argument("--fleet", nargs="?", const="", default=env.get("KVSCOPE_FLEET"),
                    help="a fleet file listing engines (docs/fleet.md); alone: an empty fleet, filled from the sidebar")
    ap.add_argument("--share", action="store_true",
                    help="(kvscope, python -m app, make run) listen on every interface: the room views, only the "
                         "presenter's link (printed on the console) drives; `streamlit run` says so with "
                         "--server.address 0.0.0.0")
    return ap


def from_command_line(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Source:
    env = os.environ if env is None else env
    if argv is None:  # `streamlit run app/main.py -- ARGS` leaves ARGS after the script path
        argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("main.py") else []
    args, rest = parser(env).parse_known_args(argv)
    rest += shlex.split(env.get("KVSCOPE_ENGINE_ARGS", ""))
    if args.fleet is not None:
        return Source("fleet", path=str(Path(args.fleet).expanduser().resolve()) if args.fleet else "",
                      model=args.model)
    if args.trace:
        return Source("trace", path=str(Path(args.trace).expanduser().resolve()), engine_args=tuple(rest))
    if args.kv_events:
        return Source("kv_events", url=args.kv_events, tokenizer=args.tokenizer)
    if args.vllm is not None:
        named = any(a == "--model" or a.startswith("--model=") for a in argv)
        # `--vllm --model gemma3` (and `make run-vllm ARGS="--model gemma3"`) name vLLM's model too
        model = args.model if named and args.vllm == "smollm2" else args.vllm
        return Source("vllm", model=model, engine_args=tuple(rest))
    if args.engine:
        return Source("attach", url=args.engine, token=args.token)
    if args.replay:
        return Source("replay", path=str(recording_path(args.replay).resolve()), speed=args.speed)
    return Source("embedded", model=args.model, engine_args=tuple(rest))
