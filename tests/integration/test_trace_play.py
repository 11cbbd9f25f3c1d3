"""Playing a trace live (engine/lab/trace_play.py): the trace replay behind the real engine server,
its events over the real WebSocket into the dashboard's own client. The client's mirror reproduces
the player's pool, and the hit rate it counts is the sweep's point at the same capacity and policy."""
from __future__ import annotations

import time

import pytest

from kvscope_contract import protocol as p
from app.link.client import EngineClient
from engine.lab.trace import scan
from engine.lab.trace_play import TracePlayer, main as play_main, player_hub
from engine.lab.trace_sweep import replay
from engine.serve.hub import serve_in_thread
from tests.traces import mooncake, req, write

SLICE = 80


def _until(cond, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("policy", ["lru", "opt"])
def test_a_played_trace_reaches_the_sweeps_point_through_the_websocket(policy):
    path = mooncake("conversation")
    blocks = 400  # small enough to evict on this slice
    player = TracePlayer(path, blocks, policy, requests=SLICE)
    # 2 ms a step: its 2,285 steps play for seconds, not the 0.2 s they take unpaced, so the client
    # watches many frames however loaded the machine (CI saw an unpaced play end in two)
    srv = serve_in_thread(player_hub(player, step_delay_ms=2))  # it plays once a client asks for the pool
    time.sleep(1)
    assert player.log.seq == 0
    client = EngineClient(srv.url)
    try:
        seen = []
        _until(lambda: client.bounds() is not None)
        _until(lambda: (seen.append(client.bounds()[1]) or not player.has_unfinished())
               and client.bounds()[1] == player.log.seq)
        assert len(set(seen)) > 3  # watched over many frames, not only at the end
        assert client.hello.server == "kvscope trace replay" and not client.supports("submit")
        assert client.wait_reply(client.send(p.Submit(prompt="hi"))).code == "unsupported"
        assert client.view().mirror.tally.since == "engine start"  # it counts from the trace's start
        view = client.view()
        mine, theirs = view.mirror.state.snapshot(), player.snapshot()
        assert mine.device_blocks == theirs.device_blocks and mine.seqs == theirs.seqs == []
        point = replay(scan(path, 512, SLICE), blocks, policy)
        tally = view.mirror.tally
        assert (tally.hit_tokens, tally.looked_up_tokens) == (point.hit_tokens, point.looked_up_tokens)
        assert client.status.resyncs == 0, "the client fell behind the player's queue"
        assert point.evictions > 0 and sum(isinstance(e, p.Evict) for e in client.events_before(None, 10**6)) \
            == point.evictions
    finally:
        client.close()
        srv.stop()


def test_a_bad_trace_is_refused_before_serving(tmp_path, caplog):
    path = write(tmp_path, [req(0, [0, 1]), req(1, [5, 1])])
    assert play_main([str(path), "--port", "0"]) == 2
    assert f"{path}:2" in caplog.text and "hash_ids[1] = 1" in caplog.text
