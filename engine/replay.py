"""Serve a recording (from `engine.server --record`) with the same protocol, without torch.

    python -m engine.replay assets/demo_recording.jsonl [--port 8765] [--speed 2] [--loop]

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

from engine.cli import add_listen_args, refuse_open_bind, serve_until_signal, setup_logging
from engine.contract import protocol as p
from engine.contract.state import PoolState
from engine.hub import PACING_COMMANDS, Client, Hub, Pacing

log = logging.getLogger("kvscope")
MAX_GAP_S = 1.0
REPLAY_COMMANDS = (*PACING_COMMANDS, "snapshot")


class Recording:
    def __init__(self, path: Path):
        messages = [p.decode_server_message(line) for line in path.read_bytes().splitlines() if line.strip()]
        hellos = [m for m in messages if isinstance(m, p.Hello)]
        snaps = [i for i, m in enumerate(messages) if isinstance(m, p.Snapshot)]
        if not hellos or not snaps:
            raise ValueError(f"{path} is not a KVScope recording: it needs a hello and a snapshot")
        self.hello = msgspec.structs.replace(hellos[0], replay=True, supports=list(REPLAY_COMMANDS))
        self.start: p.Snapshot = messages[snaps[0]]
        # later snapshots (after a reset) follow from the events: the reducer rebuilds them
        self.batches = [m.events for m in messages[snaps[0]:] if isinstance(m, p.Events) and m.events]
        self.num_events = sum(len(b) for b in self.batches)


class Playback:
    """The replay's backend: plays the recording's batches into the hub on its loop."""

    def __init__(self, rec: Recording, speed: float = 1.0, loop: bool = False):
        self.rec, self.speed, self.loop = rec, speed, loop
        self.hub: Hub | None = None
        self.state = PoolState.from_snapshot(rec.start)
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
        return self.pacing.stamp(self.rec.hello)

    def request_snapshot(self) -> None:
        self.hub.deliver_snapshot(self.state.snapshot())  # same loop: after every event so far

    def handle(self, cmd: p.AnyCommand, client: Client) -> None:
        if not self.pacing.handle(cmd):
            raise p.CommandError("unsupported", f"{cmd.__struct_config__.tag} needs a live engine; "
                                 "this server replays a recording")
        self.hub.reply(client, p.Ack(op=cmd.__struct_config__.tag, id=cmd.id))
        self._wake.set()

    async def _wait_turn(self, gap_s: float) -> None:
        """Wait the recorded gap (or the pace), then for a step when paused."""
        pace = self.pacing.step_delay_ms / 1000
        delay = pace or min(gap_s / self.speed, MAX_GAP_S)
        if delay > 0:
            await asyncio.sleep(delay)
        while not self.pacing.may_step:
            self._wake.clear()
            await self._wake.wait()
        self.pacing.stepped()

    async def run(self) -> None:
        rel = [[ev.seq - self.rec.start.seq for ev in batch] for batch in self.rec.batches]
        while True:
            base = self.state.last_event  # later passes are renumbered, so seq keeps rising by one
            prev_t = self.rec.batches[0][0].t if self.rec.batches else 0.0
            for batch, offsets in zip(self.rec.batches, rel):
                await self._wait_turn(batch[0].t - prev_t)
                prev_t = batch[0].t
                for ev, off in zip(batch, offsets):
                    ev.seq = base + off
                    self.state.apply(ev)
                self.hub.publish_events(batch)
                if any(isinstance(ev, p.Reset) for ev in batch):
                    self.hub.deliver_snapshot(self.state.snapshot(), everyone=True)
                self.batches_played += 1
            if not self.loop:
                return
            await self._wait_turn(MAX_GAP_S)
            # back to the start: a `reset` event, then the first snapshot, numbered on from here
            reset = p.Reset(config=self.rec.start.config, seq=self.state.last_event + 1, t=prev_t)
            self.hub.publish_events([reset])
            self.state = PoolState.from_snapshot(self.rec.start)
            self.state.last_event = reset.seq
            self.hub.deliver_snapshot(self.state.snapshot(), everyone=True)


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
    except (OSError, ValueError, msgspec.DecodeError) as e:
        log.error("%s", e)
        return 2
    hub = Hub(Playback(rec, args.speed, args.loop), token=args.token)
    try:
        serve_until_signal(hub, args.host, args.port, lambda port: log.info(
            "ready: ws://%s:%d/ replaying %s (%d events)", args.host, port, args.file, rec.num_events))
    except OSError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
