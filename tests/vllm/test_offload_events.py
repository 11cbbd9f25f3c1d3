"""The KV-event view of an offloading vLLM (issue 36): events built by vLLM's own classes and published
by its own ZmqEventPublisher (tests/vllm/offload_publisher.py, in the vLLM virtualenv), read by the
subscriber the dashboard runs: the CPU medium is the host tier, a store without tokens is read, and a
block announced twice stays until it is removed twice."""
from __future__ import annotations

import subprocess

import pytest

from integrations.kv_events.decode import vllm_hash_hex
from integrations.kv_events.model import tier_kind, tier_label
from integrations.kv_events.subscriber import KVEventsSubscriber
from kvscope_contract.ready import free_ports
from tests.vllm.vllm_server import NO_VLLM, ROOT, VLLM_PYTHON
from tests.waiting import wait

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM)]
H1, H2 = vllm_hash_hex(0x1111_2222_3333_4444), vllm_hash_hex(0x5555_6666_7777_8888)


def test_an_offloading_vllms_events_fill_the_host_tier_reference_counted():
    port, replay = free_ports(2)
    proc = subprocess.Popen([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm" / "offload_publisher.py"), str(port),
                             str(replay)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert proc.stdout.readline().strip() == "published 5"
        sub = KVEventsSubscriber(f"tcp://127.0.0.1:{port}?topic=kv&replay=tcp://127.0.0.1:{replay}")
        try:
            wait(lambda: sub.state.batches == 5, 60, "vLLM's five batches, through replay")
            with sub.lock:
                s = sub.state
                assert s.unknown_events == s.bad_frames == 0, list(s.errors)
                assert s.per_medium() == {"CPU": 2}  # the device evicted both; H2 announced twice, removed once
                host = s.forest("CPU")[0]
                assert set(host.nodes) == {H1, H2} and host.nodes[H2].copies == 1 and host.nodes[H1].tokens == []
                assert s.stored == 5 and s.removed == 3 and set(s.evicted) == {H1, H2}
        finally:
            sub.close()
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert [tier_kind(m) for m in ("GPU", "CPU", "CPU_TIER1", "CPU_TIER2", "STORAGE", "NVME")] == [
        "device", "host", "host", "storage", "storage", None]
    assert tier_label("CPU") == "the host tier (CPU)" and tier_label("NVME") == "NVME"
