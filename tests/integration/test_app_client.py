"""The dashboard's client against real engine servers: it reconnects when the engine
restarts, resynchronises after a gap, explains a refused token, and reads big snapshots."""
from __future__ import annotations


import threading

import pytest

from kvscope_contract import protocol as p
from app.link.client import EngineClient
from app.link.launcher import ServerProcess
from kvscope_contract.ready import free_port
from tests.waiting import wait


def server(*args: str) -> ServerProcess:
    proc = ServerProcess("engine.serve.server", ["--model", "tiny", *args]).start()
    assert proc.wait_ready(90), "\n".join(proc.tail(30))
    return proc


@pytest.fixture
def client_and_server():
    made: list = []
    yield made
    for x in made:
        (x.close if isinstance(x, EngineClient) else x.stop)()


def test_reconnects_and_starts_over_when_the_engine_restarts(client_and_server):
    port = free_port()
    first = server("--port", str(port))
    c = EngineClient(f"ws://127.0.0.1:{port}/")
    client_and_server += [c, first]
    wait(lambda: c.status.state == "connected", what="connection")
    c.wait_reply(c.send(p.Submit(prompt="before the restart", max_tokens=4)))
    wait(lambda: c.history.last_event > 5, what="events")
    before, epoch = c.history.last_event, c.epoch
    first.stop()
    wait(lambda: c.status.state == "reconnecting", what="the drop to be noticed")
    assert c.status.last_error
    with pytest.raises(Exception, match="not connected"):
        c.send(p.Pause())
    second = server("--port", str(port))
    client_and_server.append(second)
    wait(lambda: c.status.state == "connected", 30, "the reconnection")
    assert c.epoch == epoch + 1 and c.history.last_event < before  # a new engine: history starts over
    assert any("started over" in text for _, _, text in c.notices)
    c.wait_reply(c.send(p.Submit(prompt="after the restart", max_tokens=4)))
    wait(lambda: c.view().mirror.tally.finished == 1, what="the new engine's events")


def test_a_gap_in_the_stream_is_repaired_with_a_snapshot(client_and_server):
    proc = server("--port", "0")
    c = EngineClient(proc.url)
    client_and_server += [c, proc]
    wait(lambda: c.status.state == "connected", what="connection")
    c.wait_reply(c.send(p.Submit(prompt="some events first", max_tokens=3)))
    wait(lambda: c.view().mirror.tally.finished == 1, what="events")
    last = c.history.last_event
    # a frame whose numbering skips ahead, as after a lost message
    c._on_frame(p.encode(p.Events(events=[p.StepDone(seq=last + 5, num_running=0, num_waiting=0, num_swapped=0,
                                                      prefill_tokens=0, decode_tokens=0, duration_ms=0,
                                                      free_blocks=0, cached_blocks=0)])))
    wait(lambda: c.status.resyncs == 1 and not c._awaiting_snapshot, what="the resync")
    assert c.history.last_event == last  # the bogus event was never applied
    c.wait_reply(c.send(p.Submit(prompt="and after", max_tokens=3)))
    wait(lambda: c.view().mirror.tally.finished == 2, what="events after the resync")


def test_a_refused_token_is_explained_and_the_right_one_connects(client_and_server):
    proc = server("--port", "0", "--token", "s3cret")
    wrong, right = EngineClient(proc.url, "nope"), EngineClient(proc.url, "s3cret")
    client_and_server += [wrong, right, proc]
    wait(lambda: "401" in wrong.status.last_error, what="the refusal")
    assert wrong.status.state == "reconnecting" and wrong.view() is None
    wait(lambda: right.status.state == "connected", what="the right token")


def test_snapshots_larger_than_a_megabyte_arrive(client_and_server):
    proc = server("--port", "0", "--num-device-blocks", "24000", "--num-host-blocks", "16")
    c = EngineClient(proc.url)
    client_and_server += [c, proc]
    wait(lambda: c.view() is not None, 30, "the big snapshot")
    assert len(p.encode(c.view().mirror.state.snapshot())) > 1 << 20
    assert c.view().mirror.config.num_device_blocks == 24000


TALLIED = ("requests", "finished", "generated", "looked_up_tokens", "hit_tokens", "first_looked_up_tokens",
           "first_hit_tokens", "preemptions", "recomputes", "swap_outs", "swap_ins", "cows", "forks")


class Stalled(EngineClient):
    """A dashboard's client that stops reading (a busy browser session, a slow link) while
    `reading` is clear (no keepalive: a stopped reader would miss its pongs and drop the link)."""
    PING_INTERVAL_S = PING_TIMEOUT_S = None

    def __init__(self, url: str):
        self.reading = threading.Event()
        self.reading.set()
        super().__init__(url)

    def _on_frame(self, frame) -> None:
        self.reading.wait()
        super()._on_frame(frame)


def test_a_slow_clients_tallies_equal_a_fast_ones(tiny, serve_engine):
    """A client that stops reading while events flow is resynchronised by the engine with a
    snapshot in place of its queued events; the snapshot carries the engine's own counters, so
    once it reads again its header's numbers (requests, tokens, hits, preemptions, ...) are those
    of a client that read every event, and it says how many times and events it skipped."""
    from engine.config import EngineConfig
    from engine.model.engine import LLMEngine
    from app.link.source import Source
    from app.panels.header import status

    cfg = EngineConfig(model="tiny", pool=p.PoolConfig(num_device_blocks=48, num_host_blocks=0))
    srv = serve_engine(LLMEngine(cfg, tiny), max_queued_events=8)
    fast, slow = EngineClient(srv.url), Stalled(srv.url)
    try:
        wait(lambda: fast.view() is not None and slow.view() is not None, what="both attached")
        slow.reading.clear()
        prompt = " ".join(["the same long system prompt"] * 12)
        for i in range(8):  # 8 x (~60 + 400 tokens) in 48 blocks of 16: they preempt each other, and
            # their events outgrow what the kernel and the client's queue buffer (a few hundred KB)
            assert isinstance(fast.wait_reply(fast.send(p.Submit(prompt=f"{prompt} {i}", max_tokens=400,
                                                                 ignore_eos=True)), 30), p.Ack)
        wait(lambda: fast.view().mirror.tally.finished == 8, 240, "every request finished")
        assert any(c.resyncs for c in srv.hub.clients)
        slow.reading.set()
        wait(lambda: slow.bounds() == fast.bounds() or slow.history.last_event == fast.history.last_event,
             60, "the slow client caught up")
        a, b = fast.view().mirror.tally, slow.view().mirror.tally
        assert {n: getattr(b, n) for n in TALLIED} == {n: getattr(a, n) for n in TALLIED}
        assert a.preemptions > 0 and a.hit_tokens > 0 and a.finished == 8
        assert fast.status.resyncs == 0 and slow.status.resyncs >= 1 and slow.status.skipped > 0
        line = status(slow.status, slow.hello, slow.loop, slow.url, Source("attach", url=srv.url), False)
        assert f"resynced {slow.status.resyncs} time" in line and f"{slow.status.skipped:,} events skipped" in line
    finally:
        fast.close()
        slow.reading.set()
        slow.close()
