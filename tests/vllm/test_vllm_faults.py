"""A real vLLM whose API server is SIGKILLed (its engine core, which hosts the plugin, is left an
orphan): the plugin says so to its clients and the fleet card shows it, a submit sent then gets
an answer (never silence), and the orphan engine core exits. Before that, the card's vLLM hit
rate equals vLLM's own counters and the card names vLLM's OpenAI URL. Its own module and its own
server: the server dies here."""
from __future__ import annotations

import os
import signal

import pytest
from websockets.exceptions import ConnectionClosed

from tests.processes import alive, descendants
from tests.protocol_client import Client
from tests.vllm.vllm_server import NO_VLLM, VLLM_PYTHON, VllmServer
from tests.waiting import wait

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM)]

SYSTEM = ("You are a careful assistant for a paged KV cache demo. Answer in one short sentence, "
          "name the block you would reuse, and never invent numbers you were not given. ") * 3


def test_a_killed_api_server_is_said_answered_and_leaves_no_orphan():
    from app.fleet.engines import Endpoint, Fleet

    server = VllmServer(48).start()
    fleet = Fleet.of([Endpoint("vllm-x", server.ws, "vllm-plugin")])
    c, core = None, set()
    try:
        row = wait(lambda: (r := fleet.rows()[0]).state == "live" and r, 60, "the card live")
        assert row.api == server.api  # the OpenAI URL on the card: the plugin's hello.api_url
        # the card's vLLM hit rate is vLLM's own: three requests sharing a system prompt, one at a time
        for q in ("What is a block?", "What is a prefix?", "What is a page?"):
            server.post("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
        hits, queries = server.metric("vllm:prefix_cache_hits_total"), server.metric("vllm:prefix_cache_queries_total")
        assert hits > 0
        row = wait(lambda: (r := fleet.rows()[0]).first_hit_rate == hits / queries and r, 30,
                   f"the card's vLLM hit rate at {hits / queries:.3f}")

        core = descendants(server.proc.pid)
        assert core, "vLLM's engine core, a child of its API server"
        c = Client(server.ws)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        # a submit sent now is answered: an error, or the connection closed with the reason
        c.send(op="submit", id="late", prompt="Anyone there?", max_tokens=4)
        try:
            reply = c.sync(lambda m: m.get("id") == "late", timeout=20)
            assert reply["type"] == "error" and ("died" in reply["message"] or "answering" in reply["message"]), reply
        except ConnectionClosed:
            assert "API server" in (c.ws.close_reason or ""), c.ws.close_reason
        # the card says why, greyed as last seen
        row = wait(lambda: (r := fleet.rows()[0]).state == "down" and r, 30, "the card down")
        assert f"vLLM's API server (pid {server.proc.pid}) died" in row.error and row.seen_s_ago is not None
        # and the orphan engine core exits (vLLM's own shutdown on SIGTERM)
        wait(lambda: not any(alive(p) for p in core), 90, "the orphan engine core gone")
        assert any("orphan" in line for line in server.lines), list(server.lines)[-20:]
    finally:
        if c is not None:
            c.close()
        fleet.close()
        server.stop()
        for pid in core:  # whatever this test leaves, it leaves nothing running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
