"""Play a request trace live: the trace replay (engine/lab/trace_replay.py) step by step behind the
real engine server (engine.serve.server's EngineLoop and Hub), every allocator event out over the
WebSocket, so the dashboard's grid, block tables, misses panel and time travel draw it as they
draw an engine.

    python -m engine.lab.trace_play conversation_trace.jsonl --blocks 1048576 --block-size 16 \
        --policy lru --requests 300 --step-delay-ms 50 [--port 0]

One capacity under one eviction policy, as one point of a sweep (`python -m engine.lab
trace:PATH`): the same TraceLab, run by `EngineCore.step` (the lab's stepwise path, whose numbers
equal its fast path's), so the hit rate it reaches at the end is that point's. The step pace is the
server's (`--step-delay-ms`, and the dashboard's pace control while it plays); pause, step and
run-to-the-next-key-event work as on the engine. It starts once a client holds the pool's first
snapshot (so a dashboard counts every lookup), and takes no prompts and no reset: the trace is the
traffic.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from kvscope_contract import protocol as p
from kvscope_contract.ready import ready_line, ws_url
from engine.core.engine_core import StepResult
from engine.core.eviction import load_policy, policy_name
from engine.lab.trace import TRACE_BLOCK, TraceError, scan
from engine.lab.trace_replay import TraceLab, _Arrivals
from engine.lab.trace_sweep import BATCH_TOKENS, MAX_SEQS, STEP_MS, lab_config
from engine.serve.cli import add_listen_args, refuse_open_bind, serve_until_signal, setup_logging
from engine.serve.hub import PACING_COMMANDS
from engine.serve.server import engine_hub

log = logging.getLogger("kvscope")
SUPPORTS = [*PACING_COMMANDS, "snapshot", "abort", "clear_prefix_cache"]
# steps' events queued for a client before the hub drops them for a snapshot: far more than an engine's
# 256, since a dashboard counts the played point's hit rate from the events it saw (a loaded machine
# lags seconds behind a fast pace); a step's events are a few KB
QUEUED_STEPS = 8192
NOT_HERE = "a trace replay plays its trace: it takes no prompts and no reset (start another replay instead)"


class TracePlayer(TraceLab):
    """A TraceLab with the engine server's engine API: `step` admits the arrivals due (as
    `Lab.run` does) and runs one full engine step; events are kept for the server to drain,
    stamped with the wall time."""

    def __init__(self, path: Path | str, blocks: int, policy: str = "lru", *, block_size: int = TRACE_BLOCK,
                 requests: int | None = None, step_ms: float = STEP_MS, one_at_a_time: bool = False,
                 max_num_batched_tokens: int = BATCH_TOKENS, max_num_seqs: int = MAX_SEQS,
                 long_prefill_token_threshold: int = 0):
        index = scan(path, block_size, requests)  # the whole slice checked before anything plays
        if not index.requests:
            raise TraceError(f"{path}: no requests")
        cfg = lab_config(blocks, block_size, max_num_batched_tokens, max_num_seqs)
        super().__init__(cfg, index, load_policy(policy)(), step_ms=step_ms, one_at_a_time=one_at_a_time,
                         limit=index.requests, keep_events=True,
                         long_prefill_token_threshold=long_prefill_token_threshold)
        self.policy = policy_name(policy)
        self.name = Path(path).name
        self.loaded = SimpleNamespace(name=f"trace {self.name}")
        self.arrivals = _Arrivals(self, 2 * max_num_seqs)
        self.t0 = time.monotonic()
        self.watched = False  # a client has asked for the pool: until then nothing plays

    def capture(self):
        """The pool for a snapshot: the first one a client asks for starts the play, so the
        client's counters see every lookup from the trace's first request on."""
        self.watched = True
        return super().capture()

    def snapshot(self) -> p.Snapshot:
        """The pool for the server's metrics (at its start): not a client watching."""
        return super().capture().state().snapshot()

    def hello(self) -> p.Hello:
        info = p.EngineInfo(model=f"trace {self.name}: {self.index.requests:,} requests, {self.policy} eviction",
                            device="cpu", dtype="none", num_layers=0, num_kv_heads=0, head_dim=0)
        return p.Hello(engine=info, config=self.pool, server="kvscope trace replay", supports=list(SUPPORTS))

    def has_unfinished(self) -> bool:
        return self.watched and (bool(self.arrivals) or self.scheduler.has_work())

    def step(self) -> StepResult:
        pending, sched = self.arrivals, self.scheduler
        while pending and (pending[0].arrival <= self.log.step or not sched.has_work()):
            self._add(pending.popleft())
        return super().step()

    def drain_events(self) -> list[p.Event]:
        events = super().drain_events()
        t = round(time.monotonic() - self.t0, 6)
        for ev in events:
            ev.t = t
        return events

    def add_request(self, *args, **kwargs) -> list[str]:
        raise p.CommandError("unsupported", NOT_HERE)

    def reset(self, pool: p.PoolConfig) -> None:
        raise p.CommandError("unsupported", NOT_HERE)


def player_hub(player: TracePlayer, step_delay_ms: float = 0.0, **hub_kw):
    """The player behind the engine server's hub, whose clients may lag `QUEUED_STEPS` steps
    before a snapshot replaces their events."""
    return engine_hub(player, step_delay_ms, max_queued_events=QUEUED_STEPS, **hub_kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a request trace in the Mooncake format (docs/traces.md)")
    ap.add_argument("--blocks", type=int, default=1 << 20, help="device blocks (default 1,048,576)")
    ap.add_argument("--block-size", type=int, default=TRACE_BLOCK, help="tokens per block, a divisor of 512")
    ap.add_argument("--policy", default="lru", help="lru, lfu, opt or module:Class")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests (default: all)")
    ap.add_argument("--step-ms", type=float, default=STEP_MS, help="trace time per engine step, for arrivals")
    ap.add_argument("--one-at-a-time", action="store_true", help="each request once the one before finished")
    ap.add_argument("--max-num-batched-tokens", type=int, default=BATCH_TOKENS)
    ap.add_argument("--max-num-seqs", type=int, default=MAX_SEQS)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0, help="a prefill's most tokens a step")
    ap.add_argument("--step-delay-ms", type=float, default=50.0, help="wall time between steps (the pace)")
    add_listen_args(ap, port=0)
    args = ap.parse_args(argv)
    setup_logging()
    if refuse_open_bind(args.host, args.token):
        return 2
    try:
        player = TracePlayer(args.trace, args.blocks, args.policy, block_size=args.block_size,
                             requests=args.requests, step_ms=args.step_ms, one_at_a_time=args.one_at_a_time,
                             max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                             long_prefill_token_threshold=args.long_prefill_token_threshold)
    except (OSError, ValueError, p.CommandError) as e:  # a bad line names it; a pool the manager refuses
        log.error("%s", e)
        return 2
    hub = player_hub(player, args.step_delay_ms, token=args.token)
    serve_until_signal(hub, args.host, args.port, lambda port: log.info(ready_line(
        ws_url(args.host, port), f"playing {player.index.requests:,} requests of {args.trace.name} on "
                                 f"{args.blocks:,} blocks of {args.block_size} ({player.policy})")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
