"""The engine server: the paged engine in its own thread, the protocol over WebSockets.

    python -m engine.server [--model smollm2] [--port 8765] [--step-delay-ms 0] [--record FILE] ...

Commands reach the engine thread through a queue and run between steps; its events leave
through the Hub after every step. The engine never waits on a client.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine import protocol as p
from engine.config import EngineConfig, add_engine_args, config_from_args
from engine.hub import Client, Hub, Pacing
from engine.sequence import SamplingParams

log = logging.getLogger("kvscope")
MAX_WAITING = 1024  # requests queued beyond this are refused with `busy`


class EngineLoop(threading.Thread):
    """Steps the engine whenever it has work and is not paused; runs commands between steps."""

    def __init__(self, engine, hub: Hub, step_delay_ms: float = 0.0):
        super().__init__(name="kvscope-engine", daemon=True)
        self.engine, self.hub = engine, hub
        self.commands: queue.Queue = queue.Queue()
        self.pacing = Pacing(step_delay_ms=step_delay_ms)
        self.steps_run = 0
        self.stopping = threading.Event()

    # The hub calls these on its loop thread; they only enqueue.
    def hello(self) -> p.Hello:
        return self.pacing.stamp(self.engine.hello())

    def request_snapshot(self) -> None:
        self.commands.put(("snapshot", None, None))

    def handle(self, cmd: p.AnyCommand, client: Client) -> None:
        self.commands.put(("command", cmd, client))

    # ------------------------------------------------------------------ the engine thread
    def run(self) -> None:
        while not self.stopping.is_set():
            self._run_commands(block=False)
            runnable = self.engine.has_unfinished() and self.pacing.may_step
            if not runnable:
                self._run_commands(block=True, timeout=0.1)
                continue
            try:
                if not self.engine.step():  # nothing could be scheduled: do not spin
                    self._run_commands(block=True, timeout=0.01)
            except Exception:
                log.exception("engine step failed; its sequences were finished with reason 'error'")
            self.steps_run += 1
            self.pacing.stepped()
            self._publish()
            if self.pacing.step_delay_ms:
                self._sleep(self.pacing.step_delay_ms / 1000)

    def _sleep(self, seconds: float) -> None:
        """Pace between steps, still answering commands meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self.stopping.is_set():
            self._run_commands(block=True, timeout=min(left, 0.05))
            if not self.pacing.step_delay_ms:  # pace 0 cancels the wait
                return

    def _run_commands(self, block: bool, timeout: float = 0.0) -> None:
        try:
            item = self.commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            kind, cmd, client = item
            if kind == "snapshot":
                self._publish()
                self.hub.call(self.hub.deliver_snapshot, self.engine.snapshot())
            else:
                try:
                    extra = self._execute(cmd) or {}
                    self.hub.call(self.hub.reply, client, p.Ack(op=cmd.__struct_config__.tag,
                                                                id=cmd.id, **extra))
                    if isinstance(cmd, p.ResetCmd):  # the ack, the `reset` event, then a snapshot to all
                        self._publish()
                        self.hub.call(self.hub.deliver_snapshot, self.engine.snapshot(), True)
                except p.CommandError as e:
                    e.op, e.id = cmd.__struct_config__.tag, cmd.id
                    self.hub.call(self.hub.reply, client, e.to_message())
                except Exception as e:  # a bug must not take the engine down
                    log.exception("command %s failed", cmd)
                    self.hub.call(self.hub.reply, client, p.Error(
                        code="invalid_argument", message=f"internal error: {e}",
                        op=cmd.__struct_config__.tag, id=cmd.id))
                self._publish()
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, cmd: p.AnyCommand) -> dict | None:
        eng = self.engine
        if self.pacing.handle(cmd):
            return None
        match cmd:
            case p.Submit():
                if len(eng.scheduler.waiting) >= MAX_WAITING:
                    raise p.CommandError("busy", f"{MAX_WAITING} requests are already waiting; "
                                         "try again when some have finished")
                params = SamplingParams(max_tokens=cmd.max_tokens, temperature=cmd.temperature,
                                        top_p=cmd.top_p, n=cmd.n, seed=cmd.seed,
                                        ignore_eos=cmd.ignore_eos)
                messages = [{"role": m.role, "content": m.content} for m in cmd.messages or []]
                seq_ids = eng.add_request(cmd.prompt, params, messages=messages or None,
                                          request_id=cmd.request_id)
                return {"request_id": seq_ids[0], "seq_ids": seq_ids}
            case p.Abort():
                if not eng.abort(cmd.request_id):
                    raise p.CommandError("not_found", f"no running request {cmd.request_id!r}")
            case p.ResetCmd():
                eng.reset(cmd.config.apply_to(eng.pool))
            case p.ClearPrefixCache():
                eng.clear_prefix_cache()
        return None

    def _publish(self) -> None:
        self.engine.finished.clear()  # clients learn of finished requests from the events
        events = self.engine.log.drain()
        if events:
            self.hub.call(self.hub.publish_events, events)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KVScope engine server (WebSocket protocol v1)")
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    ap.add_argument("--token", default=None, help="required of clients; needed to bind beyond loopback")
    ap.add_argument("--step-delay-ms", type=float, default=0.0, help="pause between steps, for humans")
    ap.add_argument("--record", type=Path, default=None, help="append every server message to FILE (JSON lines)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[kvscope] %(message)s", stream=sys.stderr)
    if not _is_loopback(args.host) and not args.token:
        log.error("refusing to bind %s without --token: anyone on the network could drive the engine",
                  args.host)
        return 2
    from engine.engine import LLMEngine  # torch is imported only once the arguments are sound

    config: EngineConfig = config_from_args(args)
    engine = LLMEngine(config, progress=lambda msg: log.info(msg))
    return serve(engine, args.host, args.port, args.token, args.step_delay_ms, args.record)


async def _serve(engine, host: str, port: int, on_ready, step_delay_ms: float = 0.0, **hub_kw) -> None:
    hub = Hub(None, **hub_kw)
    engine_loop = hub.backend = EngineLoop(engine, hub, step_delay_ms)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def ready(bound: int) -> None:
        engine_loop.start()
        cfg = engine.pool
        log.info("ready: ws://%s:%d/ serving %s, %d device blocks of %d tokens, %d host blocks",
                 host, bound, engine.loaded.name, cfg.num_device_blocks, cfg.block_size,
                 cfg.num_host_blocks)
        on_ready(RunningServer(f"ws://{host}:{bound}/", hub, engine_loop, threading.current_thread(),
                               lambda: loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))))

    await hub.serve(host, port, ready, stop)
    engine_loop.stopping.set()
    engine_loop.join(timeout=10)


@dataclass
class RunningServer:
    url: str
    hub: Hub
    engine_loop: EngineLoop
    thread: threading.Thread
    request_stop: Callable[[], None]  # safe from any thread

    def stop(self) -> None:
        """Stop serving; from another thread, also wait until the engine thread is done."""
        if not self.thread.is_alive():
            return
        self.request_stop()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=30)


def serve(engine, host: str, port: int, token: str | None = None, step_delay_ms: float = 0.0,
          record: Path | None = None) -> int:
    """Serve in this thread until SIGINT or SIGTERM."""
    def on_ready(server: RunningServer) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, server.request_stop)

    asyncio.run(_serve(engine, host, port, on_ready, step_delay_ms, token=token, record=record))
    log.info("stopped")
    return 0


def start_in_thread(engine, host: str = "127.0.0.1", port: int = 0, step_delay_ms: float = 0.0,
                    **hub_kw) -> RunningServer:
    """Serve from a background thread (tests, benchmarks); returns once it listens.
    `hub_kw`: token, record, max_queued_events."""
    box: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: asyncio.run(_serve(engine, host, port, box.put, step_delay_ms,
                                                                **hub_kw)),
                              name="kvscope-server", daemon=True)
    thread.start()
    return box.get(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
