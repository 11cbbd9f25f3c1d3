"""Where the dashboard's events come from: an embedded engine (the default), a running engine
to attach to, or a recording to replay.

    streamlit run app/main.py                                  # embedded engine, bundled model
    streamlit run app/main.py -- --model tiny --num-device-blocks 1024   # other flags go to the engine
    streamlit run app/main.py -- --engine ws://HOST:PORT [--token T]
    streamlit run app/main.py -- --replay assets/demo_recording.jsonl [--speed 2]

The same settings can come from the environment (KVSCOPE_ENGINE, KVSCOPE_TOKEN,
KVSCOPE_REPLAY, KVSCOPE_MODEL), which is how the tests choose.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Source:
    kind: Literal["embedded", "attach", "replay"] = "embedded"
    url: str = ""                       # attach
    token: str = ""                     # attach
    path: str = ""                      # replay
    speed: float = 1.0                  # replay
    model: str = "smollm2"              # embedded
    engine_args: tuple[str, ...] = ()   # embedded: further engine.server flags

    @property
    def label(self) -> str:
        if self.kind == "attach":
            return "attached engine"
        if self.kind == "replay":
            return f"replay of {Path(self.path).name}"
        return f"embedded engine ({self.model})"

    def server_args(self) -> tuple[str, tuple[str, ...]]:
        """The module and flags of the child server an embedded or replay source runs."""
        if self.kind == "replay":
            return "engine.replay", (self.path, "--port", "0", "--loop", "--speed", f"{self.speed:g}")
        return "engine.server", ("--model", self.model, "--port", "0", *self.engine_args)


def recordings() -> list[Path]:
    """Recordings offered by the replay picker: those bundled in assets/."""
    return sorted((ROOT / "assets").glob("*.jsonl"))


def from_command_line(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Source:
    env = os.environ if env is None else env
    if argv is None:  # `streamlit run app/main.py -- ARGS` leaves ARGS after the script path
        argv = sys.argv[1:] if sys.argv and sys.argv[0].endswith("main.py") else []
    ap = argparse.ArgumentParser(prog="streamlit run app/main.py --", allow_abbrev=False)
    ap.add_argument("--engine", default=env.get("KVSCOPE_ENGINE", ""), help="attach to ws://HOST:PORT")
    ap.add_argument("--token", default=env.get("KVSCOPE_TOKEN", ""))
    ap.add_argument("--replay", default=env.get("KVSCOPE_REPLAY", ""), help="replay a recording")
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed")
    ap.add_argument("--model", default=env.get("KVSCOPE_MODEL", "smollm2"), help="embedded engine's model")
    args, rest = ap.parse_known_args(argv)
    rest += shlex.split(env.get("KVSCOPE_ENGINE_ARGS", ""))
    if args.engine:
        return Source("attach", url=args.engine, token=args.token)
    if args.replay:
        return Source("replay", path=str(Path(args.replay).expanduser().resolve()), speed=args.speed)
    return Source("embedded", model=args.model, engine_args=tuple(rest))
