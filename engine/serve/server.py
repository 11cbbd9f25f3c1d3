"""The engine server: the paged engine in its own thread, the protocol over WebSockets.

    python -m engine.serve.server [--model smollm2] [--port 8765] [--step-delay-ms 0] [--record FILE] ...

Commands reach the engine thread through a queue and run between steps; its events leave
through the Hub after every step. The engine never waits on a client. `GET /metrics` on the
same port: Prometheus metrics (engine/serve/metrics.py, docs/metrics.md); `GET /tokenize?prompt=`
the prompt's token ids, as a plain prompt is tokenized (vLLM's /tokenize answer: tokens, count).
"""
from __future__ import annotations

import argparse
import logging
import queue
import sys
import threading
import time
from pathlib import Path

from engine.serve.cli import add_listen_args, refuse_open_bind, serve_until_signal, setup_logging
from engine.config import add_engine_args, config_from_args
from kvscope_contract import protocol as p
from kvscope_contract.ready import ready_line, ws_url
from engine.serve.hub import Client, Hub, Pacing, Serving, serve_in_thread
from engine.serve.metrics import EngineMetrics
from engine.core.sequence import SamplingParams

log = logging.getLogger("kvscope")
MAX_WAITING = p.MAX_NUM_SEQS  # requests queued beyond this are refused with `busy`
IDLE_WAIT_S = 0.1         # with nothing to run, wait this long for a command before checking for stop
NOTHING_RAN_WAIT_S = 0.01  # a step that could schedule nothing: wait before trying again, not spin
PACE_SLICE_S = 0.05       # while pacing, commands are still answered at least this often
STOP_WAIT_S = 10.0        # stop() waits this long for the step in flight


class EngineLoop:
    """Steps the engine in its own thread whenever it has work and is not paused; runs
    commands between steps. The hub's backend: its methods called from the hub only enqueue."""

    def __init__(self, engine, step_delay_ms: float = 0.0):
        self.engine = engine
        self.hub: Hub | None = None
        self.metrics = EngineMetrics(engine.loaded.name, engine.snapshot)  # fed by _publish
        self.commands: queue.Queue = queue.Queue()
        self.pacing = Pacing(step_delay_ms=step_delay_ms)
        self.steps_run = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kvscope-engine", daemon=True)

    def start(self, hub: Hub) -> None:
        self.hub = hub
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=STOP_WAIT_S)  # let the step in flight end

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
                self._run_commands(block=True, timeout=IDLE_WAIT_S)
                continue
            try:
                if not self.engine.step().scheduled:  # nothing could run: do not spin
                    self._run_commands(block=True, timeout=NOTHING_RAN_WAIT_S)
            except Exception:
                log.exception("engine step failed; its sequences were finished with reason 'error'")
            self.steps_run += 1
            events = self.engine.drain_events()
            self.pacing.stepped(events)
            self._publish(events)
            if self.pacing.step_delay_ms:
                self._sleep(self.pacing.step_delay_ms / 1000)

    def _sleep(self, seconds: float) -> None:
        """Pace between steps, still answering commands meanwhile."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self.stopping.is_set():
            self._run_commands(block=True, timeout=min(left, PACE_SLICE_S))
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
                self.hub.call(self.hub.deliver_snapshot, self.engine.capture().state, False, self.metrics.counters())
            else:
                try:
                    extra = self._execute(cmd) or {}
                    self.hub.call(self.hub.reply, client, p.Ack(op=cmd.__struct_config__.tag,
                                                                id=cmd.id, **extra))
                    if isinstance(cmd, p.ResetCmd):  # the ack, the `reset` event, then a snapshot to all
                        self._publish()
                        self.hub.call(self.hub.deliver_snapshot, self.engine.capture().state, True,
                                      self.metrics.counters())
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
                if eng.num_waiting >= MAX_WAITING:
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

    def _publish(self, events: list[p.Event] | None = None) -> None:
        """Send the events so far (then a change of the loop's pace or pause, if any)."""
        if events := (events or []) + self.engine.drain_events():
            self.metrics.observe(events)
            self.hub.call(self.hub.publish_events, events)
        if (state := self.pacing.take_change()) is not None:
            self.hub.call(self.hub.broadcast_loop, state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KVScope engine server (WebSocket protocol v1)")
    add_engine_args(ap)
    add_listen_args(ap)
    ap.add_argument("--step-delay-ms", type=float, default=0.0, help="pause between steps, for humans")
    ap.add_argument("--record", type=Path, default=None, help="append every server message to FILE (JSON lines)")
    args = ap.parse_args(argv)
    setup_logging()
    if refuse_open_bind(args.host, args.token):
        return 2
    from engine.model.engine import LLMEngine  # torch is imported only once the arguments are sound

    engine = LLMEngine(config_from_args(args), progress=lambda msg: log.info(msg))
    hub = engine_hub(engine, args.step_delay_ms, token=args.token, view_token=args.view_token, record=args.record)
    serve_until_signal(hub, args.host, args.port, lambda port: _say_ready(engine, args.host, port))
    log.info("stopped")
    return 0


def _say_ready(engine, host: str, port: int) -> None:
    cfg = engine.pool
    log.info(ready_line(ws_url(host, port), f"serving {engine.loaded.name}, {cfg.num_device_blocks} device blocks "
                                            f"of {cfg.block_size} tokens, {cfg.num_host_blocks} host blocks"))


def start_in_thread(engine, host: str = "127.0.0.1", port: int = 0, step_delay_ms: float = 0.0,
                    **hub_kw) -> Serving:
    """Serve `engine` from a background thread (tests, benchmarks); returns once it listens.
    `hub_kw`: token, record, max_queued_events."""
    return serve_in_thread(engine_hub(engine, step_delay_ms, **hub_kw), host, port)


def engine_hub(engine, step_delay_ms: float = 0.0, **hub_kw) -> Hub:
    """The engine's loop behind a hub, with its Prometheus metrics at GET /metrics and its
    tokenizer at GET /tokenize."""
    loop = EngineLoop(engine, step_delay_ms)
    return Hub(loop, metrics=loop.metrics.render, tokenize=getattr(engine, "tokenize", None),
               tokenize_chat=getattr(engine, "tokenize_chat", None), **hub_kw)


if __name__ == "__main__":
    sys.exit(main())
