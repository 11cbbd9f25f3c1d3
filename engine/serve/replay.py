"""Serve a recording (from `engine.serve.server --record`) with the same protocol, without torch.

    python -m engine.serve.replay assets/demo_recording.jsonl [--port 8765] [--speed 2] [--loop]

Events go out in their recorded batches at their recorded pace (times `--speed`; idle gaps
are cut to a second). pause / resume / step / pace drive the playback; commands that need an
engine (submit, abort, reset, clear_prefix_cache) answer `unsupported`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import msgspec

from engine.serve.cli import add_listen_args, refuse_open_bind, serve_until_signal, setup_logging
from kvscope_contract import protocol as p
from kvscope_contract.ready import ready_line, ws_url
from kvscope_contract.counters import StreamCounter
from kvscope_contract.recording import Recording
from kvscope_contract.state import PoolState
from engine.serve.hub import PACING_COMMANDS, Client, Hub, Pacing

log = logging.getLogger("kvscope")
MAX_GAP_S = 1.0
REPLAY_COMMANDS = (*PACING_COMMANDS, "snapshot")


class Playback:
    """The replay's backend: plays the recording's batches into the hub on its loop."""

    def __init__(self, rec: Recording, speed: float = 1.0, loop: bool = False):
        self.rec, self.speed, self.loop = rec, speed, loop
        self.hub: Hub | None = None
        self.state = PoolState.from_snapshot(rec.start)
        self.counter = StreamCounter()  # what a client would tally, for each snapshot
        self.pacing = Pacing()
        self.batches_played = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, hub: Hub) -> None:
        self.hub = hub
        self._task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def hello(self) -> p.Hello:
        return self.pacing.stamp(msgspec.structs.replace(self.rec.hello, replay=True, supports=list(REPLAY_COMMANDS)))

    def request_snapshot(self) -> None:
        # same loop: after every event so far
        self.hub.deliver_snapshot(self.state.clone(), counters=self.counter.wire())

    def handle(self, cmd: p.AnyCommand, client: Client) -> None:
        if not self.pacing.handle(cmd):
            raise p.CommandError("unsupported", f"{cmd.__struct_config__.tag} needs a live engine; "
                                 "this server replays a recording")
        self.hub.reply(client, p.Ack(op=cmd.__struct_config__.tag, id=cmd.id))
        self._announce()
        self._wake.set()

    def _announce(self) -> None:
        if (state := self.pacing.take_change()) is not None:
            self.hub.broadcast_loop(state)

    async def _wait_turn(self, gap_s: float) -> None:
        """Wait the recorded gap (or the pace), then for a step when paused."""
        pace = self.pacing.step_delay_ms / 1000
        delay = pace or min(gap_s / self.speed, MAX_GAP_S)
        if delay > 0:
            await asyncio.sleep(delay)
        while not self.pacing.may_step:
            self._wake.clear()
            await self._wake.wait()

    def _play(self, batch: list[p.Event]) -> None:
        for ev in batch:
            self.counter.observe(ev, self.state)
            self.state.apply(ev)
        self.hub.publish_events(batch)
        self.pacing.stepped(batch)
        self._announce()

    async def run(self) -> None:
        """Play the batches; each later pass is renumbered so that event numbers, steps and
        times keep rising across passes, as if one engine ran the recording again and again."""
        first = self.rec.batches[0][0] if self.rec.batches else p.StepDone(
            num_running=0, num_waiting=0, num_swapped=0, prefill_tokens=0, decode_tokens=0,
            duration_ms=0, free_blocks=0, cached_blocks=0)
        offsets = [[(ev.seq - self.rec.start.seq, ev.step - first.step, ev.t - first.t) for ev in batch]
                   for batch in self.rec.batches]
        step, t = first.step, first.t
        while True:
            seq0, step0, t0 = self.state.last_event, step, t
            prev_t = first.t
            for batch, offs in zip(self.rec.batches, offsets):
                await self._wait_turn(batch[0].t - prev_t)
                prev_t = batch[0].t
                for ev, (d_seq, d_step, d_t) in zip(batch, offs):
                    ev.seq, ev.step, ev.t = seq0 + d_seq, step0 + d_step, round(t0 + d_t, 6)
                step, t = batch[-1].step, batch[-1].t
                self._play(batch)
                if any(isinstance(ev, p.Reset) for ev in batch):
                    self.hub.deliver_snapshot(self.state.clone(), everyone=True, counters=self.counter.wire())
                self.batches_played += 1
            if not self.loop:
                return
            await self._wait_turn(MAX_GAP_S)
            # back to the start: a `reset` event, then the first snapshot, numbered on from here
            step, t = step + 1, t + MAX_GAP_S
            reset = p.Reset(config=self.rec.start.config, seq=self.state.last_event + 1, step=step, t=round(t, 6))
            self._play([reset])
            self.state = PoolState.from_snapshot(self.rec.start)
            self.state.last_event = reset.seq
            self.hub.deliver_snapshot(self.state.clone(), everyone=True, counters=self.counter.wire())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Replay a KVScope recording over the WebSocket protocol")
    ap.add_argument("file", type=Path)
    add_listen_args(ap)
    ap.add_argument("--speed", type=float, default=1.0, help="playback speed factor")
    ap.add_argument("--loop", action="store_true", help="start over at the end")
    args = ap.parse_args(argv)
    setup_logging()
    if refuse_open_bind(args.host, args.token):
        return 2
    try:
        rec = Recording(args.file)
    except (OSError, ValueError) as e:
        log.error("%s", e)
        return 2
    if rec.damage:
        log.warning("%s: %s; replaying the %d whole events before it", args.file, rec.damage, rec.num_events)
    hub = Hub(Playback(rec, args.speed, args.loop), token=args.token, view_token=args.view_token)
    try:
        serve_until_signal(hub, args.host, args.port, lambda port: log.info(
            ready_line(ws_url(args.host, port), f"replaying {args.file} ({rec.num_events} events)")))
    except OSError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
