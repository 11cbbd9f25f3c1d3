"""The prefix forest: the model on its own (any source), built from KVScope's events it equals
the block manager's prefix cache at every step (nodes, parents, holders, eviction order), and a
client following a real replay server gets the same forest live and at past events."""
from __future__ import annotations

import pytest

from kvscope_contract.snapshot_codec import hash_hex
from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig
from kvscope_contract.state import PoolState
from engine.serve.hub import Hub, serve_in_thread
from engine.lab.record import record
from engine.lab.sim import Lab
from engine.lab.workload import load
from engine.serve.replay import Playback
from kvscope_contract.recording import Recording
from app.link.client import EngineClient
from app.history.follow import Follower
from app.derived.prefix_events import ForestBuilder
from app.panels.prefix_tree import render
from kvscope_contract.prefix_forest import CACHED_ONLY, IN_USE, UNKNOWN, PrefixForest
from tests.waiting import wait


def test_the_model_keeps_chains_branches_holders_and_eviction_order():
    f = PrefixForest()
    f.store("c", "b", "child first", holders=1, at=3)  # streams may deliver a child before its parent
    f.store("a", None, "You are", holders=2, at=1)
    f.store("b", "a", " a tutor", holders=2, at=2)
    f.store("d", "b", " other", holders=1, at=4)
    assert [n.key for n in f.roots()] == ["a"]
    assert [n.key for n in f.chain(f.nodes["a"])] == ["a", "b"] and [n.key for n in f.kids(f.nodes["b"])] == ["c", "d"]
    for key in ("a", "a", "b"):
        f.hit(key)
    for key in ("d", "c", "b", "a"):  # released tail first, as the allocator frees
        f.hold(key, 0)
    assert list(f.lru) == [("d", 0), ("c", 0), ("b", 0), ("a", 0)] and f.victim == "d"
    assert f.nodes["a"].state == CACHED_ONLY
    f.hold("c", 1)  # a prefix hit revives it: it leaves the eviction queue
    assert f.victim == "d" and ("c", 0) not in f.lru and f.nodes["c"].state == IN_USE
    f.remove("b")  # evicting a middle block leaves its children as roots of their own
    assert [n.key for n in f.roots()] == ["a", "c", "d"]
    f.store("b", "a", " a tutor", holders=0, at=9)  # computed and cached again: re-attached, a new entry
    assert [n.key for n in f.kids(f.nodes["a"])] == ["b"] and f.nodes["b"].hits == 0
    f.hit("b")
    f.store("b", "a", " a tutor", holders=1, at=10)  # stored while present: a second copy, hits kept
    assert f.nodes["b"].hits == 1 and f.nodes["b"].stored == 10 and f.nodes["b"].copies == 2
    assert f.stats() == {"blocks": 4, "copies": 5, "roots": 1, "groups": 0, "in use": 2, "cached only": 2,
                         "hits": 3, "leaves": 2}
    html = render(f, highlight={7})
    assert "You are" in html and "next evicted" in html and "<b>3</b>" not in html
    assert '<span class="h">2 hits</span>' in html and '<span class="h">1 hit</span>' in html
    assert html.count(' victim"') == 1 and "3 hits" in html  # one victim chip; the total
    assert '<span class="h">×2 copies</span>' in html and "5 physical blocks" in html
    assert f.remove("b") and f.nodes["b"].copies == 1 and [n.key for n in f.kids(f.nodes["a"])] == ["b"]
    assert not f.remove("nowhere")
    f.store("z", None, medium="CPU", tokens=[5, 6])  # a source that does not know holders (vLLM's KV events)
    assert f.nodes["z"].state == UNKNOWN and f.victim == "d" and f.nodes["z"].tokens == [5, 6]
    f.clear()
    assert not f.nodes and f.victim is None and "empty" in render(f)


def check_against(builder: ForestBuilder, lab: Lab) -> None:
    bm, forest = lab.block_manager, builder.forest
    assert set(forest.nodes) == {hash_hex(h) for h in bm.cache.maps[0]}
    for key, node in forest.nodes.items():
        b = node.block
        assert hash_hex(bm.cache.hashes[b]) == key and node.holders == bm.pool.ref_counts[b]
        if node.parent is not None and node.parent in forest.nodes:  # the chained hash holds
            parent = bm.cache.hashes[forest.nodes[node.parent].block]
            assert hash_hex(hash((parent, *bm.cache.tokens[b]))) == key
    assert [key for key, _ in forest.lru] == [hash_hex(bm.cache.hashes[b]) for b in bm.pool.evictable]
    assert forest.victim == (hash_hex(bm.cache.hashes[next(iter(bm.pool.evictable))]) if bm.pool.evictable else None)


def stepped(pool: p.PoolConfig, *chat_args):
    """(lab, forest builder, the step's events) before the first step (no events) and after each
    step of the chat workload mixed with the parallel one (forks and copy-on-write), the builder
    fed every event."""
    workload = load("chat", *chat_args)
    workload.requests = sorted(workload.requests + load("parallel").requests, key=lambda r: r.arrival)
    lab = Lab(LabConfig(pool=pool), workload, keep_events=True)
    builder = ForestBuilder.from_state(PoolState.from_snapshot(lab.snapshot()))
    yield lab, builder, []
    while lab.has_unfinished() or workload.requests:
        while workload.requests and (workload.requests[0].arrival <= lab.log.step or not lab.has_unfinished()):
            lab._add(workload.requests.pop(0))
        lab.step()
        events = lab.drain_events()
        for ev in events:
            builder.apply(ev)
        yield lab, builder, events


@pytest.mark.parametrize("pool", [
    p.PoolConfig(block_size=16, num_device_blocks=120, num_host_blocks=64),               # evictions, swaps
    p.PoolConfig(block_size=4, num_device_blocks=200, preemption_mode="recompute"),       # recompute re-hits
    p.PoolConfig(block_size=8, num_device_blocks=2048),                                   # everything stays
])
def test_built_from_events_it_is_the_block_managers_prefix_cache_at_every_step(pool):
    steps = 0
    for lab, builder, _ in stepped(pool, 2):
        check_against(builder, lab)
        steps += 1
    assert steps > 100 and builder.forest.nodes
    assert any(n.hits for n in builder.forest.nodes.values())


def check_hybrid(builder: ForestBuilder, lab: Lab) -> None:
    """A node per hash, with each KV-cache group's block that caches it; in use while any is held;
    the eviction order the pool's, entry by (hash, group)."""
    bm, forest = lab.block_manager, builder.forest
    cached = {}
    for g, blocks in enumerate(bm.cache.maps):
        for h, b in blocks.items():
            cached.setdefault(hash_hex(h), {})[g] = b
    assert {k: n.blocks for k, n in forest.nodes.items()} == cached
    for node in forest.nodes.values():
        assert node.held == {g: bm.pool.ref_counts[b] for g, b in node.blocks.items()}
        assert node.holders == max(node.held.values()) and node.copies == len(node.blocks)
    assert list(forest.lru) == [(hash_hex(bm.cache.hashes[b]), bm.cache.group_of[b]) for b in bm.pool.evictable]


def test_on_a_hybrid_pool_a_node_is_a_hash_with_its_block_in_each_group():
    """Gemma 3's shape (5 sliding-window groups, 1 full) with a small window, so that windows free
    blocks (still cached), evictions take one group's block and leave the others, and a prompt's
    hit needs every group: at every step the forest is the block manager's caches, grouped."""
    from kvscope_contract.kv_groups import gemma3_groups
    pool = p.PoolConfig(block_size=8, num_device_blocks=900, num_host_blocks=64, kv_groups=gemma3_groups(24))
    seen = {"window_free": 0, "evict": 0, "partial": 0, "hits": 0}
    counted, admissions = [], set()
    for i, (lab, builder, events) in enumerate(stepped(pool)):
        if i == 0:  # before the first step: count the forest's hits
            hit = builder.forest.hit
            builder.forest.hit = lambda key: (counted.append(key), hit(key))
        for ev in events:
            seen["window_free"] += isinstance(ev, p.WindowFree)
            seen["evict"] += isinstance(ev, p.Evict)
            if isinstance(ev, p.PrefixHit):
                seen["hits"] += 1
                admissions.add((ev.seq_id, ev.step, ev.hash))
        check_hybrid(builder, lab)
        seen["partial"] += any(len(n.blocks) < 6 for n in builder.forest.nodes.values())
    assert all(seen.values()), seen
    assert len(counted) == len(admissions) < seen["hits"]  # an admission's groups hit a hash once, not once each
    html = render(builder.forest, groups=6)
    assert "KV-cache groups" in html and "blocks by KV-cache group: group 0:" in html


@pytest.fixture
def replay(tmp_path):
    path = tmp_path / "lab.jsonl"
    record(LabConfig(pool=p.PoolConfig(block_size=16, num_device_blocks=96)), load("chat"), path)
    playback = Playback(Recording(path), speed=1000)
    playback.pacing.paused = True  # until the client is there: it sees every event
    serving = serve_in_thread(Hub(playback))
    client = EngineClient(serving.url)
    wait(lambda: client.view() is not None, what="the client's first snapshot")
    client.send(p.Resume())
    yield client, Recording(path)
    client.close()
    serving.stop()


def test_a_client_follows_the_forest_live_and_in_time_travel(replay):
    client, rec = replay
    events = [e for batch in rec.batches for e in batch]
    wait(lambda: client.bounds()[1] == events[-1].seq, 60, "the whole recording")
    assert client.bounds()[0] == rec.start.seq
    follow = Follower(ForestBuilder.from_state)

    def direct(n: int) -> PrefixForest:
        b = ForestBuilder.from_state(PoolState.from_snapshot(rec.start))
        for ev in events:
            if ev.seq <= n:
                b.apply(ev)
        return b.forest

    def same(a: PrefixForest, b: PrefixForest) -> bool:
        key = lambda f: {k: (n.parent, n.block, n.holders, n.hits) for k, n in f.nodes.items()}
        return key(a) == key(b) and list(a.lru) == list(b.lru)

    assert same(follow.at(client, None).forest, direct(events[-1].seq))
    for n in (events[len(events) // 3].seq, events[len(events) // 2].seq, 5):  # back in time, and forward
        assert same(follow.at(client, n).forest, direct(n))
    assert follow.at(client, None).last_event == events[-1].seq
