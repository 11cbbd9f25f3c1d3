"""Run a KVScope server (the engine, or the replay of a recording) as a child process on a
free loopback port, and follow its log: the progress lines while the model loads and the
`ready: ws://...` line that gives its address.

The child dies with us even when we are killed: it asks the kernel for SIGTERM on its
parent's death (PR_SET_PDEATHSIG), and the parent is the thread that reads its log. It runs in a
process group of its own, and `stop` signals the whole group: what the child started (vLLM's
engine core) goes with it, even when the child itself died first and left it an orphan.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal

from app.link.source import ROOT
from kvscope_contract.access import TOKEN_ENV, VIEW_TOKEN_ENV
from kvscope_contract.ready import ready_url, refused_reason

# "" in a checkout; "kvscope." in the wheel, whose build puts app/, engine/, ... inside `kvscope`
PACKAGE = __name__.removesuffix("app.link.launcher")
IMPORT_ROOT = ROOT.parent if PACKAGE else ROOT  # where `python -m` finds them


def module_path(module: str) -> str:
    """`engine.serve.server` as `python -m` runs it in this layout."""
    return PACKAGE + module


# Runs the module as __main__ after arranging to die with the thread that started it.
_BOOT = ("import ctypes, os, runpy, signal, sys\n"
         "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
         "os.getppid() == int(os.environ['KVSCOPE_PARENT']) or sys.exit('kvscope: parent is gone')\n"
         "sys.argv = sys.argv[1:]\n"
         "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


@dataclass(eq=False)
class ServerProcess:
    module: str                 # engine.serve.server, engine.serve.replay or integrations.vllm.serve
    args: list[str]
    python: str = sys.executable  # vLLM's server runs in its own virtualenv
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=300))
    url: str | None = None
    returncode: int | None = None
    started: float = field(default_factory=time.time)
    ready_after: float | None = None  # seconds from start to ready
    refused: str | None = None  # why the vLLM plugin does not observe its vLLM (which runs on)
    on_exit: Callable[[ServerProcess], None] | None = None  # called on the log thread when it exits
    on_line: Callable[[str], None] | None = None  # each line of its output, on the log thread
    token: str | None = None  # required of its clients; handed over in its environment, never argv (`ps`)
    _proc: subprocess.Popen | None = None
    stopping: bool = False
    _spawned: threading.Event = field(default_factory=threading.Event)
    _handled: threading.Event = field(default_factory=threading.Event)  # exited, and on_exit has returned
    _drained: threading.Event = field(default_factory=threading.Event)  # its output closed: its group has gone

    @property
    def pid(self) -> int | None:
        """The child's process id (None before it was spawned, or when it could not start)."""
        return self._proc.pid if self._proc else None

    def wait_handled(self, timeout: float) -> bool:
        """Wait until it has exited and its `on_exit` has returned (whatever that did, it is done)."""
        return self._handled.wait(timeout)

    @property
    def argv(self) -> list[str]:
        return [self.python, "-u", "-c", _BOOT, module_path(self.module), *self.args]

    @property
    def urls(self) -> list[str]:
        """Every address its log announced (a server of several engines prints one ready line each)."""
        return [u for line in list(self.lines) if (u := ready_url(line))]

    @property
    def state(self) -> Literal["starting", "ready", "exited"]:
        return "exited" if self.returncode is not None else "ready" if self.url else "starting"

    @property
    def died(self) -> bool:
        """It was serving, then exited (killed, crashed) without being stopped by us."""
        return self.returncode is not None and self.url is not None and not self.stopping

    def exit_reason(self) -> str:
        if self._proc is None and self.returncode is not None:
            return "it could not be started"  # no process ever ran: no exit code, no signal
        code = self.returncode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    @property
    def command(self) -> str:
        return " ".join(["python -m", self.module, *self.args])

    def start(self) -> ServerProcess:
        threading.Thread(target=self._follow, name=f"kvscope-{self.module}", daemon=True).start()
        self._spawned.wait(30)
        atexit.register(self.stop)
        return self

    def _follow(self) -> None:
        env = {**os.environ, "KVSCOPE_PARENT": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        for name in (TOKEN_ENV, VIEW_TOKEN_ENV):  # ours to give, not the dashboard's own (its --token attaches)
            env.pop(name, None)
        if self.token:
            env[TOKEN_ENV] = self.token
        try:
            self._proc = subprocess.Popen(self.argv, cwd=IMPORT_ROOT, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          errors="replace", start_new_session=True)
        except OSError as e:
            self.lines.append(f"could not start {self.command}: {e}")
            if self.module.startswith("integrations.vllm") and not os.path.exists(self.python):
                self.lines.append("vLLM runs from its own virtualenv, .venv-vllm: `make vllm-venv` creates it")
            self.returncode = -1
            self._handled.set()
            return
        finally:
            self._spawned.set()
        for line in self._proc.stdout:  # until every process holding its output has exited
            line = line.rstrip()
            self.lines.append(line)
            if self.url is None and (url := ready_url(line)):
                self.url, self.ready_after = url, time.time() - self.started
            elif self.refused is None and self.url is None and (why := refused_reason(line)):
                self.refused = why
            if self.on_line:
                self.on_line(line)
        self._drained.set()
        self.returncode = self._proc.wait()
        try:
            if self.on_exit:
                self.on_exit(self)
        finally:
            self._handled.set()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.state == "starting" and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.state == "ready"

    def stop(self) -> None:
        """SIGTERM to its process group (SIGKILL after 10 s); returns once its output closed, that
        is once every process of the group that held it is gone."""
        self.stopping = True
        proc = self._proc
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return  # the group is gone
            if self._drained.wait(wait_s):
                return

    def tail(self, n: int = 12) -> list[str]:
        return list(self.lines)[-n:]
