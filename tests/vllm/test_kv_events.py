"""The ZMQ KV-event mode without vLLM: the decoder on both encodings and on garbage, the model
of what the stream shows, and the subscriber against real ZMQ PUB and ROUTER sockets that
speak vLLM's wire format (tests/vllm/test_vllm.py feeds it a real vLLM)."""
from __future__ import annotations


import pytest

from app.modes.kv_events_view import block_text
from app.panels.prefix_tree import STATE_COLORS, render
from kvscope_contract.prefix_forest import UNKNOWN
from integrations.kv_events.decode import (Cleared, FrameError, Removed, Stored, decode_batch,
                                           decode_frames, vllm_hash_hex)
from integrations.kv_events.model import KVEventsState
from integrations.kv_events.subscriber import Endpoint, KVEventsSubscriber
from tests.waiting import wait
from tests.kv_event_stream import Publisher, frames, pack, stored_map

H1, H2, H3 = 0x1111_2222_3333_4444, 0xAAAA_BBBB_CCCC_DDDD, 7


def test_map_and_positional_encodings_decode_to_the_same_events():
    as_maps = [stored_map([H1, H2], parent=H3), {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"},
               {"type": "AllBlocksCleared"}]
    as_arrays = [["BlockStored", [H1, H2], H3, [0, 1, 2, 3], 2, None, "GPU"],
                 ["BlockRemoved", [H1], "GPU"], ["AllBlocksCleared"]]
    a, b = decode_batch(pack([2.5, as_maps, 0])), decode_batch(pack([2.5, as_arrays]))
    assert a.events == b.events == [
        Stored([vllm_hash_hex(H1), vllm_hash_hex(H2)], vllm_hash_hex(H3), [0, 1, 2, 3], 2, "GPU"),
        Removed([vllm_hash_hex(H1)], "GPU"), Cleared(None)]
    assert a.ts == 2.5 and a.dp_rank == 0 and b.dp_rank is None and not a.unknown


def test_old_positional_events_without_a_medium_and_a_batch_as_a_map():
    batch = decode_batch(pack({"ts": 3, "events": [["BlockStored", [H1], None, [5, 6], 2, None]],
                               "data_parallel_rank": 1}))
    assert batch.events == [Stored([vllm_hash_hex(H1)], None, [5, 6], 2, "GPU")] and batch.dp_rank == 1


def test_bytes_and_int_hashes_name_the_same_block():
    raw = bytes(range(24)) + H1.to_bytes(8, "big")  # vLLM publishes the low 64 bits as an int
    assert vllm_hash_hex(raw) == vllm_hash_hex(H1) == "1111222233334444"
    assert vllm_hash_hex(-1) == "ffffffffffffffff"
    with pytest.raises(FrameError):
        vllm_hash_hex(1.5)


@pytest.mark.parametrize("payload", [b"", b"\xc1garbage", pack("text"), pack([1.0]), pack(["x", []]),
                                     pack([1.0, "not a list"]), pack({"ts": 1})])
def test_garbage_payloads_are_frame_errors(payload):
    with pytest.raises(FrameError):
        decode_batch(payload)


def test_unreadable_events_are_skipped_and_counted_the_rest_kept():
    batch = decode_batch(pack([1.0, [{"type": "BlockWarmed"}, 42, ["BlockStored", "nope"],
                                     stored_map([H1], size=0), stored_map([True]),
                                     stored_map([H2], tokens=["a"]), stored_map([H3])]]))
    assert len(batch.unknown) == 6 and batch.events == [Stored([vllm_hash_hex(H3)], None, [0, 1], 2, "GPU")]
    assert "unknown event type 'BlockWarmed'" in batch.unknown[0]


def test_frames_need_a_topic_a_sequence_number_and_a_payload():
    assert decode_frames(frames(5, [])).seq == 5
    assert decode_frames(frames(5, [])[1:]).seq == 5  # no topic frame
    for bad in ([b"x"], [b"", b"123", pack([1.0, []])], [b"", b"", b"", b""]):
        with pytest.raises(FrameError):
            decode_frames(bad)


def test_the_model_keeps_cached_blocks_per_medium_their_forest_and_the_counts():
    s = KVEventsState()
    s.apply(decode_frames(frames(0, [stored_map([H1, H2], tokens=[1, 2, 3, 4])])))
    s.apply(decode_frames(frames(1, [stored_map([H3], parent=H1, tokens=[9, 9]),
                                     stored_map([H1], medium="CPU", tokens=[1, 2])])))
    assert s.per_medium() == {"GPU": 3, "CPU": 1} and s.stored == 4
    gpu = s.forests["GPU"]
    assert [n.key for n in gpu.roots()] == [vllm_hash_hex(H1)]  # the root, and two prompts that share it
    assert [n.key for n in gpu.kids(gpu.nodes[vllm_hash_hex(H1)])] == [vllm_hash_hex(H2), vllm_hash_hex(H3)]
    assert gpu.nodes[vllm_hash_hex(H2)].tokens == [3, 4] and list(s.forests["CPU"].nodes) == [vllm_hash_hex(H1)]
    s.apply(decode_frames(frames(4, [{"type": "BlockRemoved", "block_hashes": [H1, 12345], "medium": "GPU"}])))
    assert s.missed == 2 and s.removed == 2 and s.removed_unknown == 1
    assert [n.key for n in gpu.roots()] == [vllm_hash_hex(H2), vllm_hash_hex(H3)]  # orphans: roots
    s.apply(decode_frames(frames(5, [["AllBlocksCleared"]])))
    assert s.per_medium() == {} and s.cleared == 1 and [pt.cached for pt in s.points] == [2, 4, 3, 0]


def test_the_same_content_cached_twice_stays_until_both_copies_are_removed():
    """vLLM does not de-duplicate: a greedy request that decodes what another did fills a new
    block with the same hash; each copy is stored and removed on its own."""
    s = KVEventsState()
    s.apply(decode_frames(frames(0, [stored_map([H1]), stored_map([H1])])))
    assert s.per_medium() == {"GPU": 2} and len(s.forests["GPU"].roots()) == 1
    s.apply(decode_frames(frames(1, [["BlockRemoved", [H1], "GPU"]])))
    assert s.per_medium() == {"GPU": 1} and s.removed_unknown == 0
    s.apply(decode_frames(frames(2, [["BlockRemoved", [H1], "GPU"]])))
    assert s.per_medium() == {} and not s.forests["GPU"].nodes


def test_the_page_draws_each_mediums_forest_with_each_blocks_text_and_no_holders():
    """The page draws the forest as the History panel's prefix tree does: a chip per cached
    content, under the block its prefix continues, with its tokens' text (token ids without a
    tokenizer); the stream says nothing of holders, hits or the eviction order."""
    s = KVEventsState()
    s.apply(decode_frames(frames(0, [stored_map([H1, H2], tokens=[1, 2, 3, 4]), stored_map([H1], tokens=[1, 2]),
                                     stored_map([H3], parent=H1, tokens=[9, 8])])))
    page = render(s.forests["GPU"], text=lambda n: block_text(n, None))
    assert page.count('class="id"') == 3 and page.count('class="row"') == 3  # a root row, two branches
    assert page.index('title="hash 1111222233334444') < page.index('<div class="kids">') < page.index("&#x27;9 8&#x27;")
    assert '<span class="tx">3 4</span>' in page and "×2 copies" in page and "4 physical blocks" in page
    assert "unknown (the source does not say)" in page and "next evicted" not in page and " victim" not in page
    assert page.count(f"--c:{STATE_COLORS[UNKNOWN]}") == 3 and "hits" not in page.split("</div>", 1)[1]


def test_endpoints_parse_topic_and_replay_and_refuse_other_urls():
    e = Endpoint.parse("tcp://10.0.0.2:5557?topic=kv&replay=tcp://10.0.0.2:5558")
    assert e == Endpoint("tcp://10.0.0.2:5557", "kv", "tcp://10.0.0.2:5558")
    for bad in ("http://x:1", "5557", "tcp://"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)


def cached(sub: KVEventsSubscriber) -> set[str]:
    """The hashes it holds cached on the GPU."""
    with sub.lock:  # its thread changes the forests
        return set(sub.state.forests["GPU"].nodes) if "GPU" in sub.state.forests else set()


def test_a_late_subscriber_catches_up_through_replay_then_follows_the_live_stream():
    pub = Publisher()
    try:
        pub.send(0, [stored_map([H1])])
        pub.send(1, [stored_map([H2], parent=H1)])
        sub = KVEventsSubscriber(f"tcp://127.0.0.1:{pub.port}?topic=kv&replay=tcp://127.0.0.1:{pub.replay_port}")
        try:
            wait(lambda: cached(sub) == {vllm_hash_hex(H1), vllm_hash_hex(H2)}, 10, "the replayed batches")
            wait(lambda: (pub.send(2, [stored_map([H3])]), vllm_hash_hex(H3) in cached(sub))[1], 10, "a live batch")
            pub.send(99, [], raw=[b"kv", (100).to_bytes(8, "big"), b"\xc1 not msgpack"])
            # after every copy of H3 sent before it: one PUB-SUB connection keeps the order
            wait(lambda: sub.state.bad_frames == 1, 10, "the garbage frame to be counted")
            with sub.lock:
                copies = sub.state.forests["GPU"].nodes[vllm_hash_hex(H3)].copies
            pub.send(101, [{"type": "BlockRemoved", "block_hashes": [H3] * copies, "medium": "GPU"}])
            wait(lambda: cached(sub) == {vllm_hash_hex(H1), vllm_hash_hex(H2)}, 10, "the thread to go on after garbage")
            assert sub.state.unknown_events == 0 and "not msgpack" in sub.state.errors[-1]
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_topic_filter_ignores_other_topics():
    pub = Publisher(topic=b"other")
    try:
        sub = KVEventsSubscriber(f"tcp://127.0.0.1:{pub.port}?topic=kv")
        try:
            for seq in range(20):  # PUB drops until the subscription lands: send a few
                pub.send(seq, [stored_map([seq + 1])])
            pub.topic = b"kv"
            wait(lambda: (pub.send(100, [stored_map([H1])]), cached(sub))[1], 10, "a kv batch")
            assert cached(sub) == {vllm_hash_hex(H1)} and list(sub.state.forests) == ["GPU"]
        finally:
            sub.close()
    finally:
        pub.close()
