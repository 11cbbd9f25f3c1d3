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
                                     stored_map([H1], size=0, tokens=[1, 2]), stored_map([True]),
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
    gpu = s.forest("GPU")[0]
    assert [n.key for n in gpu.roots()] == [vllm_hash_hex(H1)]  # the root, and two prompts that share it
    assert [n.key for n in gpu.kids(gpu.nodes[vllm_hash_hex(H1)])] == [vllm_hash_hex(H2), vllm_hash_hex(H3)]
    assert gpu.nodes[vllm_hash_hex(H2)].tokens == [3, 4] and list(s.forest("CPU")[0].nodes) == [vllm_hash_hex(H1)]
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
    assert s.per_medium() == {"GPU": 2} and len(s.forest("GPU")[0].roots()) == 1
    s.apply(decode_frames(frames(1, [["BlockRemoved", [H1], "GPU"]])))
    assert s.per_medium() == {"GPU": 1} and s.removed_unknown == 0
    s.apply(decode_frames(frames(2, [["BlockRemoved", [H1], "GPU"]])))
    assert s.per_medium() == {} and not s.forest("GPU")[0].nodes


# vLLM 0.32's BlockStored of a hybrid model's sliding-window group, every field it sends, and
# fields a later release may add (ignored)
HYBRID_STORED = {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None,
                 "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": 7, "medium": "GPU",
                 "lora_name": "sql-adapter", "extra_keys": [["sql-adapter", "salt-1"], None], "group_idx": 3,
                 "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 512, "locality": "LOCAL",
                 "ownership": None, "session_id": "s1", "lookahead_token_ids": None, "a_later_field": [1]}


def test_a_hybrid_models_events_keep_the_group_its_spec_the_locality_and_the_extra_keys():
    as_array = ["BlockStored", *[HYBRID_STORED[k] for k in list(HYBRID_STORED)[1:]]]  # positional, in vLLM's order
    removed_map = {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 3,
                   "locality": "LOCAL", "ownership": None}
    a = decode_batch(pack([1.0, [HYBRID_STORED, removed_map]]))
    b = decode_batch(pack([1.0, [as_array, ["BlockRemoved", [H1], "GPU", 3, "LOCAL", None]]]))
    want = Stored([vllm_hash_hex(H1), vllm_hash_hex(H2)], None, [1, 2, 3, 4], 2, "GPU", group=3,
                  spec_kind="sliding_window", sliding_window=512, locality="LOCAL",
                  extra_keys=[("sql-adapter", "salt-1"), None], lora="sql-adapter")
    assert a.events == b.events == [want, Removed([vllm_hash_hex(H1)], "GPU", group=3, locality="LOCAL")]
    assert not a.unknown and not b.unknown
    # metadata of the wrong type reads as absent, never fails the event; vLLM 0.27's lora_id alone names the LoRA
    odd = decode_batch(pack([1.0, [dict(HYBRID_STORED, group_idx="3", kv_cache_spec_sliding_window=True,
                                        extra_keys=[["x"]], lora_name=None, locality=5)]])).events[0]
    assert (odd.group, odd.sliding_window, odd.extra_keys, odd.lora, odd.locality) == (None, None, None, "7", None)


def test_a_prefix_stored_by_every_group_of_a_hybrid_model_is_one_prefix_not_six_copies():
    """Gemma 3: five sliding-window groups and one full-attention group each store a prompt's
    blocks, under the same hashes: 6 physical blocks per block of the prompt, each group's own
    layers, none of them a duplicate. A second copy within one group is one; vLLM removes each
    group's copy on its own."""
    s = KVEventsState()
    kinds = [("sliding_window", 512)] * 5 + [("full_attention", None)]
    s.apply(decode_frames(frames(0, [dict(stored_map([H1, H2], tokens=[1, 2, 3, 4]), group_idx=g,
                                          kv_cache_spec_kind=k, kv_cache_spec_sliding_window=w)
                                     for g, (k, w) in enumerate(kinds)])))
    assert s.per_medium() == {"GPU": 12} and s.per_group("GPU") == {g: 2 for g in range(6)}
    assert s.prefixes("GPU") == 2 and s.duplicated("GPU") == 0 and s.groups() == list(range(6))
    assert s.specs[0].label() == "sliding window (512 tokens)" and s.specs[5].label() == "full attention"
    forest, held = s.forest("GPU")
    assert len(forest.nodes) == 2 and all(n.copies == 1 for n in forest.nodes.values())
    assert held[vllm_hash_hex(H2)] == list(range(6)) and [n.key for n in forest.roots()] == [vllm_hash_hex(H1)]
    s.apply(decode_frames(frames(1, [dict(stored_map([H1], tokens=[1, 2]), group_idx=5)])))  # a real duplicate
    assert s.duplicated("GPU") == 1 and s.forest("GPU")[0].nodes[vllm_hash_hex(H1)].copies == 2
    s.apply(decode_frames(frames(2, [{"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0},
                                     ["BlockRemoved", [H1], "GPU", 5]])))
    assert s.per_group("GPU")[0] == 1 and s.per_group("GPU")[5] == 2 and s.removed_unknown == 0
    assert s.forest("GPU")[1][vllm_hash_hex(H2)] == [1, 2, 3, 4, 5] and s.duplicated("GPU") == 0
    s.apply(decode_frames(frames(3, [dict(stored_map([H3], medium="CPU"), group_idx=0, locality="REMOTE")])))
    assert s.tiers() == ["CPU (remote)", "GPU"] and s.per_medium()["CPU (remote)"] == 1
    s.apply(decode_frames(frames(4, [["AllBlocksCleared"]])))
    assert s.per_medium() == {} and s.prefixes("GPU") == 0


def test_the_page_draws_each_mediums_forest_with_each_blocks_text_and_no_holders():
    """The page draws the forest as the History panel's prefix tree does: a chip per cached
    content, under the block its prefix continues, with its tokens' text (token ids without a
    tokenizer); the stream says nothing of holders, hits or the eviction order."""
    s = KVEventsState()
    s.apply(decode_frames(frames(0, [stored_map([H1, H2], tokens=[1, 2, 3, 4]), stored_map([H1], tokens=[1, 2]),
                                     stored_map([H3], parent=H1, tokens=[9, 8])])))
    page = render(s.forest("GPU")[0], text=lambda n: block_text(n, None))
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
        return set(sub.state.forest("GPU")[0].nodes)


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
                copies = sub.state.forest("GPU")[0].nodes[vllm_hash_hex(H3)].copies
            pub.send(101, [{"type": "BlockRemoved", "block_hashes": [H3] * copies, "medium": "GPU"}])
            wait(lambda: cached(sub) == {vllm_hash_hex(H1), vllm_hash_hex(H2)}, 10, "the thread to go on after garbage")
            assert sub.state.unknown_events == 0 and "not msgpack" in sub.state.errors[-1]
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_restarted_publisher_is_said_and_followed_anew():
    """A restarted vLLM numbers its batches from 0 again and caches nothing from before: the
    subscriber says so, drops the old cache and follows the new stream (it ignored every batch up
    to the old last number, as replayed overlap), with and without a replay socket."""
    for replay in (True, False):
        pub = Publisher()
        try:
            url = f"tcp://127.0.0.1:{pub.port}?topic=kv" + (
                f"&replay=tcp://127.0.0.1:{pub.replay_port}" if replay else "")
            sub = KVEventsSubscriber(url)
            try:
                seq = iter(range(1000))
                wait(lambda: (pub.send(next(seq), [stored_map([H1])]), cached(sub))[1], 10, "the first publisher")
                pub.send(next(seq), [stored_map([H2], parent=H1)])
                wait(lambda: vllm_hash_hex(H2) in cached(sub), 10, "its second batch")
                pub.buffer.clear()  # a new publisher: numbers from 0, an empty replay buffer
                pub.send(0, [stored_map([H3])])
                wait(lambda: cached(sub) == {vllm_hash_hex(H3)}, 10, "the new publisher's cache alone")
                assert sub.state.restarts == 1 and "the publisher restarted" in sub.state.errors[-1]
                pub.send(1, [stored_map([H1])])
                wait(lambda: cached(sub) == {vllm_hash_hex(H3), vllm_hash_hex(H1)}, 10, "its next batch")
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
            assert cached(sub) == {vllm_hash_hex(H1)} and sub.state.tiers() == ["GPU"]
        finally:
            sub.close()
    finally:
        pub.close()


def test_the_page_shows_a_hybrid_models_cache_per_group_and_each_prefix_once(monkeypatch):
    """The KV-events page on a stream of Gemma 3's shape (six groups storing one prompt): a
    row per group with its kind and blocks, the prompt's blocks counted as content once, no
    duplicate, a chip per block of content; and what a salted block's hash covers."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from tests.vllm.vllm_server import ROOT

    pub = Publisher(topic=b"")
    kinds = [("sliding_window", 512)] * 5 + [("full_attention", None)]
    for g, (k, w) in enumerate(kinds):
        pub.send(g, [dict(stored_map([H1, H2], tokens=[1, 2, 3, 4]), group_idx=g, kv_cache_spec_kind=k,
                          kv_cache_spec_sliding_window=w, extra_keys=[None, ["salt-7"]])])
    monkeypatch.setenv("KVSCOPE_KV_EVENTS", f"tcp://127.0.0.1:{pub.port}?replay=tcp://127.0.0.1:{pub.replay_port}")
    st.cache_resource.clear()
    try:
        at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=30)
        label = "cached on the device (GPU)"
        at = wait(lambda: (a := at.run()) and any(m.label == label and m.value == "12" for m in a.metric)
                  and a, 30, "the page to count the six groups' blocks")
        assert any("2 blocks of content · 0 duplicated · 6 KV-cache groups" in c.value for c in at.caption)
        rows = at.dataframe[0].value
        assert list(rows["group"]) == list(range(6)) and list(rows["blocks on GPU"]) == [2] * 6
        assert list(rows["kind"]) == ["sliding window (512 tokens)"] * 5 + ["full attention"]
        forest = next(h.value for h in at.html if 'class="pt"' in h.value)
        assert forest.count('class="id"') == 2 and "×" not in forest and "[salt-7] 3 4" in forest
        assert not at.exception
    finally:
        st.cache_resource.clear()
        pub.close()


def test_the_fleet_counts_a_hybrid_models_groups_as_one_copy_and_a_second_engines_as_duplicates():
    """Two engines' KV-event streams, each of a hybrid model (two sliding-window groups and a
    full-attention one) caching the same prompt: the fleet holds 2 x 3 x 2 physical blocks, each
    content twice (once per engine), so 6 duplicated blocks (one per group and block), not 10;
    a prefix-aware router finds the prompt on both, and not on an engine whose full-attention
    group lost it."""
    from app.fleet.engines import Endpoint, Fleet

    kinds = [("sliding_window", 4), ("sliding_window", 4), ("full_attention", None)]
    pubs = [Publisher(topic=b""), Publisher(topic=b"")]
    for pub in pubs:
        pub.send(0, [dict(stored_map([H1, H2], tokens=[1, 2, 3, 4]), group_idx=g, kv_cache_spec_kind=k,
                          kv_cache_spec_sliding_window=w) for g, (k, w) in enumerate(kinds)])
    fleet = Fleet.of([Endpoint(n, f"tcp://127.0.0.1:{pub.port}?replay=tcp://127.0.0.1:{pub.replay_port}", "kv-events")
                      for n, pub in zip("ab", pubs)])
    try:
        wait(lambda: all(r.cached == 6 for r in fleet.rows()), 30, "both streams replayed")
        ix = fleet.index()
        assert len(ix.holders) == 2 and sum(ix.copies(c) for c in ix.holders) == 12
        assert ix.duplicated_blocks() == 6 and [ix.content_copies(c) for c in ix.holders] == [2, 2]
        assert {s.engine: s.cached_tokens for s in ix.score([1, 2, 3, 4, 5])} == {"a": 4, "b": 4}
        pubs[1].send(1, [["BlockRemoved", [H2], "GPU", 2]])  # b's full-attention group evicts block 2
        wait(lambda: fleet.rows()[1].cached == 5, 30, "b's removal")
        assert {s.engine: s.cached_tokens for s in fleet.index().score([1, 2, 3, 4, 5])} == {"a": 4, "b": 2}
        assert fleet.index().duplicated_blocks() == 5
    finally:
        fleet.close()
        for pub in pubs:
            pub.close()
