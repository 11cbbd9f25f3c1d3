"""The fleet's data layer against real KVScope servers (engine/synthetic.py: the real engine core,
block manager, prefix cache and WebSocket server, random tokens for the model): content identity,
duplicates, the merged forest and the router's score compared with what the engines themselves
say (their snapshots, their prefix hits), and one engine's death."""
from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

import time

from app.fleet import engines as fleet_engines
from app.fleet import load as fleet_load
from app.fleet.engines import RATE_S, STALL_S, Endpoint, Fleet, FleetFileError, load_fleet, tokenize
from app.fleet.content import chain_ids
from app.link.launcher import ServerProcess
from engine.synthetic import INDEX, WORDS
from kvscope_contract import protocol as p
from tests.protocol_client import Client
from kvscope_contract.ready import free_port
from tests.waiting import wait
from tests.synthetic import BS, synthetic_server

SYSTEM = " ".join(w.strip() for w in WORDS[100:150])         # 50 tokens: 3 full blocks
QUESTIONS = [" ".join(w.strip() for w in WORDS[500 + 20 * i:500 + 20 * i + 21]) for i in range(3)]


def tokens(text: str) -> list[int]:
    return [INDEX[w] for w in text.split()]


@pytest.fixture()
def pair():
    procs = [synthetic_server(step_delay_ms=10), synthetic_server(step_delay_ms=10)]  # 10 ms a step: see the stale test
    fleet = Fleet.of([Endpoint("a", procs[0].url), Endpoint("b", procs[1].url)])
    wait(lambda: all(r.state == "live" for r in fleet.rows()), 30, "both engines live")
    yield fleet, procs
    fleet.close()
    for proc in procs:
        proc.stop()


def run(fleet: Fleet, name: str, prompt: str) -> None:
    """Submit a prompt to one engine and wait until it has finished."""
    client = fleet.engines[name].client
    finished = client.view().mirror.tally.finished
    client.send(p.Submit(prompt=prompt, max_tokens=3, ignore_eos=True))
    wait(lambda: client.view().mirror.tally.finished > finished, 30, f"{name} finished")


def snapshot_hashes(url: str) -> Counter:
    """The hashed blocks an engine's own snapshot lists, by hash."""
    c = Client(url)
    try:
        st = c.state
        return Counter(st.hash_of(b) for b in range(st.config.num_device_blocks) if st.has_hash[b])
    finally:
        c.ws.close()


def test_duplicates_forest_and_scores_equal_what_the_engines_say(pair):
    fleet, procs = pair
    run(fleet, "a", SYSTEM + " " + QUESTIONS[0])
    run(fleet, "b", SYSTEM + " " + QUESTIONS[1])
    run(fleet, "a", QUESTIONS[2] + " " + SYSTEM)
    ix = fleet.index()
    snaps = {name: snapshot_hashes(proc.url) for name, proc in zip("ab", procs)}
    # content ids name every block (the fleet attached before the first request)
    assert ix.unknown_blocks() == 0 and ix.hash_disagreements() == 0
    # the same blocks as each engine's snapshot, by the engine's own hashes
    for name in "ab":
        held = Counter(c.server_hash for c in fleet.engines[name].contents())
        assert held == snaps[name]
    both = snaps["a"] + snaps["b"]
    dup = sum(n - 1 for n in both.values())
    assert dup == 3  # the system prompt's three full blocks
    assert ix.duplicated_blocks() == dup
    bpb = fleet.rows()[0].bytes_per_block
    assert bpb > 0 and ix.duplicated_bytes() == dup * bpb
    # the merged forest: every cached content once, the union of both engines' caches
    forest = ix.forest()
    assert len(forest.nodes) == len(both)
    assert sum(n.copies for n in forest.nodes.values()) == sum(both.values())
    assert Counter(len(ix.holders[k]) for k in forest.nodes)[2] == 3
    assert all(n.holders is None for n in forest.nodes.values())  # sequences holding it: not followed here
    assert len(forest.roots()) == 2  # SYSTEM..., QUESTIONS[2]...
    # the router's score for a prompt, per engine, equals the prefix the engine then reuses
    prompt = SYSTEM + " " + QUESTIONS[2]
    ids = tokens(prompt)
    assert tokenize(fleet.engines["a"], prompt) == tokenize(fleet.engines["b"], prompt) == ids  # GET /tokenize
    assert len(ids) % BS  # the engine computes the last partial block: full blocks only, as scored
    scores = {s.engine: s for s in ix.score(ids)}
    assert scores["a"].cached_tokens == scores["b"].cached_tokens == 48
    for name in "ab":
        client = fleet.engines[name].client
        before = client.view().mirror.tally.hit_tokens
        run(fleet, name, prompt)
        assert client.view().mirror.tally.hit_tokens - before == scores[name].reusable_tokens
    # after which a's cache holds the whole prompt's full blocks, and a router prefers... either: both
    ix = fleet.index()
    assert {s.cached_tokens for s in ix.score(ids)} == {len(chain_ids(ids, BS)) * BS}


def test_a_dead_engine_is_shown_and_the_other_stays_live(pair):
    fleet, procs = pair
    os.kill(procs[0].pid, signal.SIGKILL)
    rows = wait(lambda: (r := {x.name: x for x in fleet.rows()})["a"].state == "down" and r, 15, "a marked down")
    assert rows["b"].state == "live" and rows["a"].error
    run(fleet, "b", SYSTEM)  # b answers and its numbers move while a is down
    assert {x.name: x for x in fleet.rows()}["b"].cached >= 3


def test_a_down_engines_cache_is_last_seen_and_out_of_the_live_totals(pair):
    """Both engines cache the system prompt (3 blocks each: 3 duplicated); a is killed: its card keeps
    what it last held, says since when, and the fleet's totals count b alone (nothing duplicated)."""
    fleet, procs = pair
    run(fleet, "a", SYSTEM + " " + QUESTIONS[0])
    run(fleet, "b", SYSTEM + " " + QUESTIONS[1])
    assert fleet.index().duplicated_blocks() == 3
    cached_a = {r.name: r for r in fleet.rows()}["a"].cached
    os.kill(procs[0].pid, signal.SIGKILL)
    rows = wait(lambda: (r := {x.name: x for x in fleet.rows()})["a"].state == "down" and r, 15, "a marked down")
    assert rows["a"].cached == cached_a > 0 and rows["a"].seen_s_ago is not None and rows["a"].seen_s_ago < 15
    ix = fleet.index()
    assert ix.duplicated_blocks() == 0 and set(ix.engines) == {"b"}
    assert sum(ix.copies(c) for c in ix.holders) == rows["b"].cached
    assert [s.engine for s in ix.score(tokens(SYSTEM))] == ["b"]  # a router never picks a dead engine


def test_every_failed_send_is_counted_and_said(pair):
    """A submit the engine refuses, and submits an engine never answers before its connection
    closes (stopped, then killed), each count as failed sends, in words; an accepted one does not."""
    fleet, procs = pair
    a = fleet.engines["a"]
    a.submit(p.Submit(prompt="x", max_tokens=2, request_id="fine"))
    a.submit(p.Submit(prompt="x " * 5000, max_tokens=2, request_id="huge"))  # beyond the pool: refused
    wait(lambda: not a.client.pending, 15, "the engine's answers")
    assert a.load_failed == 1 and a.load_errors[0].startswith("huge: "), list(a.load_errors)
    refused = a.load_failed
    os.kill(procs[0].pid, signal.SIGSTOP)  # it reads nothing more: these wait in its socket unanswered
    fleet_load.send_all([("a", r) for r in fleet_load.workload(3, 1, "lost")],
                        lambda n, cmd: fleet.engines[n].submit(cmd))
    assert a.load_failed == refused  # not failed yet: unanswered
    os.kill(procs[0].pid, signal.SIGKILL)
    wait(lambda: a.load_failed == refused + 3, 30, "the three unanswered sends counted failed")
    assert all("no answer before the connection closed" in e for e in list(a.load_errors)[-3:])


def test_numbers_on_a_card_do_not_go_stale(pair, monkeypatch):
    """tokens/s falls to 0 once an engine idles; "preempting" clears once it stops preempting; an
    engine that is not up yet reads connecting, not down."""
    monkeypatch.setattr(fleet_engines, "PREEMPTING_S", 3.0)
    fleet, _ = pair
    client = fleet.engines["a"].client
    finished = client.view().mirror.tally.finished
    long = " ".join(w.strip() for w in WORDS[3000:3200])  # 200 tokens: 13 blocks each, 8 of them in 64 blocks
    assert isinstance(client.wait_reply(client.send(p.Pause())), p.Ack)  # all eight queued before any runs:
    for i in range(8):  # one at a time (a loaded machine sends slowly) none would wait for blocks
        assert isinstance(client.wait_reply(client.send(p.Submit(prompt=f"{i} {long}", max_tokens=120,
                                                                 ignore_eos=True))), p.Ack)
    assert isinstance(client.wait_reply(client.send(p.Resume())), p.Ack)
    # tokens/s counts the steps the card received: a client that fell behind, resynced by a snapshot,
    # knows the preemptions it skipped (the snapshot's counters) but not their steps until the next
    # one, so the engines take 10 ms a step (the pair fixture): this run lasts over a second (run flat out
    # in 70 ms, CI skipped it whole once)
    row = wait(lambda: (r := {x.name: x for x in fleet.rows()}["a"]).preemptions and r.tokens_per_s and r,
               60, "a preempting, its tokens/s counted")
    # flagged; the card's alarm says "no free blocks" first while the pool is full at that instant
    assert row.preempting and row.alarm in ("preempting", "no free blocks")
    wait(lambda: client.view().mirror.tally.finished >= finished + 8, 120, "a finished")
    idle = wait(lambda: (r := {x.name: x for x in fleet.rows()}["a"]).alarm == "" and r, 10, "preempting cleared")
    assert idle.preemptions > 0  # still counted, no longer flagged
    time.sleep(RATE_S + 0.5)
    assert {x.name: x for x in fleet.rows()}["a"].tokens_per_s == 0

    port = free_port()
    late = Fleet.of([Endpoint("late", f"ws://127.0.0.1:{port}/")])
    try:
        time.sleep(2)  # several refused connections: it is coming up, not down
        row = late.rows()[0]
        assert row.state == "connecting" and "Error" not in row.error and row.alarm == "", row
        proc = synthetic_server(port)
        wait(lambda: late.rows()[0].state == "live", 30, "live once it listens")
        proc.stop()
        row = wait(lambda: (r := late.rows()[0]).state == "down" and r, 30, "down once it stops")
        assert row.error and row.alarm == "down"
    finally:
        late.close()


def test_the_routing_lessons_numbers_say_they_are_its_two_engines(pair):
    """A fleet of three: the lesson runs on two, and its captions say their numbers are those two's
    alone, naming the engine the fleet-wide panel counts besides (it showed 0 duplicated blocks
    over a panel that counted 42)."""
    from app.lessons.fleet_lesson import FleetLessonRun, all_fleet_lessons, caption

    fleet, _ = pair
    third = synthetic_server()
    try:
        fleet.add(Endpoint("c", third.url))
        wait(lambda: all(r.state == "live" for r in fleet.rows()), 30, "three engines live")
        lesson = next(x for x in all_fleet_lessons() if x.key == "routing")
        run = FleetLessonRun(lesson, fleet, "tiny")
        run.next()
        run.wait()
        assert not run.errors and run.engines == ["a", "b"], run.errors
        text = caption(lesson.stops[0], run.words())
        assert "These numbers are a's and b's alone" in text and "1 other engine too: c" in text, text
    finally:
        third.stop()


def test_a_chat_is_scored_in_the_tokens_its_template_gives_and_would_reuse_follows_the_last_token_rule():
    """Two real engines (a chat template: the tiny model's SmolLM2 tokenizer). After a chat ran on a,
    its system prompt pasted as a plain prompt scores nothing (no chat markers), while the chat,
    tokenized as the engine runs chats, scores its cached blocks; "would reuse" is what the engine
    then takes from its cache for a new question under that system prompt."""
    procs = [ServerProcess("engine.serve.server", ["--model", "tiny", "--port", "0", "--block-size", "16",
                                                   "--num-device-blocks", "128"]).start() for _ in range(2)]
    fleet = Fleet.of([Endpoint(n, pr.url) for n, pr in zip("ab", procs)] if all(pr.wait_ready(120) for pr in procs)
                     else [])
    try:
        assert len(fleet.members()) == 2, [pr.tail(10) for pr in procs]
        wait(lambda: all(r.state == "live" for r in fleet.rows()), 30, "both live")
        first, second = fleet_load.workload(7, 1, "chat")[0], fleet_load.workload(7, 1, "chat")[6]
        a = fleet.engines["a"].client
        finished = a.view().mirror.tally.finished
        a.send(first.command(2))
        wait(lambda: a.view().mirror.tally.finished > finished, 60, "the first chat on a")
        chat = tokenize(fleet.engines["a"], messages=first.messages())
        added = next(e for e in a.events_before(None, 2_000)
                     if isinstance(e, p.RequestAdded) and e.request_id == first.request_id)
        assert chat == added.prompt_token_ids  # the chat as the engine ran it
        ix = fleet.index()
        plain = tokenize(fleet.engines["a"], first.system)
        score = lambda ids, name: next(s for s in ix.score(ids) if s.engine == name)  # noqa: E731
        assert score(plain, "a").cached_tokens == 0 < score(chat, "a").cached_tokens
        assert score(chat, "b").cached_tokens == 0
        again = tokenize(fleet.engines["a"], messages=second.messages())  # same system prompt, another question
        would = score(again, "a").reusable_tokens
        before = a.view().mirror.tally.hit_tokens
        a.send(second.command(2))
        wait(lambda: a.view().mirror.tally.finished > finished + 1, 60, "the second chat on a")
        assert a.view().mirror.tally.hit_tokens - before == would > 0
    finally:
        fleet.close()
        for pr in procs:
            pr.stop()


def busy(engines: int) -> ServerProcess:
    """`engines` synthetic engines in one process, each always running a few requests."""
    proc = ServerProcess("engine.synthetic", ["--port", "0", "--engines", str(engines), "--num-device-blocks", "256",
                                             "--num-host-blocks", "0", "--live", "2", "--max-num-seqs", "2",
                                             "--prompt-tokens", "32", "--max-tokens", "24", "--fill", "0",
                                             "--warm-steps", "0", "--step-delay-ms", "100"]).start()
    assert wait(lambda: proc.returncode is not None or len(proc.urls) == engines, 120, "the engines ready"), \
        "\n".join(proc.tail(30))
    assert proc.returncode is None, "\n".join(proc.tail(30))
    return proc


def test_a_stopped_engine_delays_no_other_and_is_marked(tmp_path):
    """SIGSTOP one of six busy engines: the five others' events keep arriving at their pace while
    it is marked stalled, then down (no answer to the keepalive); SIGCONT: live again."""
    victim, others = busy(1), busy(5)
    fleet = Fleet.of([Endpoint("victim", victim.url)] + [Endpoint(f"e{i}", u) for i, u in enumerate(others.urls)])
    names = [f"e{i}" for i in range(5)]
    try:
        wait(lambda: all(r.state == "live" and r.running and r.last_event_age_s is not None for r in fleet.rows()),
             60, "six busy engines live, their events arriving")
        last = {n: fleet.engines[n].client.history.last_event for n in names}
        os.kill(victim.pid, signal.SIGSTOP)
        worst, seen = 0.0, set()
        for want in ("stalled", "down"):
            def marked():
                rows = {r.name: r for r in fleet.rows()}
                for n in names:  # never one of the others held up: live, with fresh events
                    nonlocal worst
                    assert rows[n].state == "live", rows[n]
                    worst = max(worst, rows[n].last_event_age_s)
                seen.add(rows["victim"].state)
                return rows["victim"].state == want
            wait(marked, 60, f"the stopped engine marked {want}")
        assert "stalled" in seen and worst < STALL_S, (seen, worst)
        moved = {n: fleet.engines[n].client.history.last_event - last[n] for n in names}
        assert all(m > 50 for m in moved.values()), moved  # ~15 s of a step every 100 ms each
        assert "ConnectionClosed" in {r.name: r for r in fleet.rows()}["victim"].error or \
            "ping" in {r.name: r for r in fleet.rows()}["victim"].error.lower()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    wait(lambda: {r.name: r for r in fleet.rows()}["victim"].state == "live", 60, "the engine live again")
    fleet.close()
    victim.stop()
    others.stop()


def test_round_robin_duplicates_the_system_prompts_and_affinity_does_not(pair):
    fleet, _ = pair
    systems = [" ".join(w.strip() for w in WORDS[1000 + 100 * k:1000 + 100 * k + 40]) for k in range(3)]
    questions = [" ".join(w.strip() for w in WORDS[2000 + 10 * k:2000 + 10 * k + 8]) for k in range(4)]
    dup = {}
    for policy in ("affinity", "round-robin"):
        for name in "ab":  # from an empty prefix cache
            client = fleet.engines[name].client
            client.send(p.ClearPrefixCache())
            wait(lambda: not fleet.engines[name].contents(), 10, f"{name}'s prefix cache cleared")
        plan = fleet_load.assign(fleet_load.workload(12, 3, policy, system_prompts=systems, questions=questions),
                                 ["a", "b"], policy)
        done = {n: fleet.engines[n].client.view().mirror.tally.finished for n in "ab"}
        assert fleet_load.send_all(plan, lambda n, cmd: fleet.engines[n].client.send(cmd), max_tokens=3) == {}
        for name in "ab":
            want = done[name] + sum(e == name for e, _ in plan)
            wait(lambda: fleet.engines[name].client.view().mirror.tally.finished >= want, 60, f"{name} finished")
        dup[policy] = fleet.index().duplicated_blocks()
        if policy == "round-robin":  # what the plan puts where: a system prompt's first two blocks (32 of its
            # 40 words) and the third block (its last 8 words and the question's 8) on each engine that got them
            firsts = {(r.system, e) for e, r in plan}
            thirds = {(r.system, r.question, e) for e, r in plan}
            expected = 2 * (len(firsts) - len({s for s, _ in firsts})) + len(thirds) - len({t[:2] for t in thirds})
    assert dup["affinity"] == 0  # each system prompt on one engine
    assert dup["round-robin"] == expected and expected >= 6


def test_fleet_files(tmp_path):
    good = tmp_path / "fleet.toml"
    good.write_text('[[engine]]\nname = "a"\nurl = "ws://127.0.0.1:8765"\nkind = "vllm-plugin"\nrank = 1\n'
                    '[[engine]]\nname = "b"\nurl = "tcp://127.0.0.1:5557?replay=tcp://127.0.0.1:5558"\nkind = '
                    '"kv-events"\n')
    a, b = load_fleet(good)
    assert a.address == "ws://127.0.0.1:8766" and b.kind == "kv-events"
    from app.link.source import Source, from_command_line
    assert from_command_line(["--fleet", str(good)], {}) == Source("fleet", path=str(good.resolve()))
    assert from_command_line(["--fleet"], {}) == Source("fleet", path="")  # an empty fleet, filled from the sidebar
    for text, says in [('[[engine]]\nname = "a"\n', "no url"),
                       ('[[engine]]\nurl = "http://x"\n', "starts with ws://"),
                       ('[[engine]]\nurl = "ws://x:1"\nkind = "sglang"\n', "kind must be"),
                       ('[[engine]]\nurl = "ws://x:1"\nname = "a"\n[[engine]]\nurl = "ws://x:2"\nname = "a"\n',
                        "must differ"),
                       ("engine = [", "not TOML"), ("", "[[engine]]")]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(FleetFileError, match=says.replace("[", r"\[")):
            load_fleet(bad)


def test_a_kv_event_stream_names_blocks_by_the_same_content_as_a_kvscope_engine(pair):
    """A ZMQ KV-event stream (vLLM's wire format, other hashes) and a KVScope engine caching the
    same tokens: one content, two holders, and the page warns that their hashes differ."""
    from tests.kv_event_stream import Publisher, stored_map

    fleet, _ = pair
    run(fleet, "a", SYSTEM)
    ids = tokens(SYSTEM)[:3 * BS]
    pub = Publisher(topic=b"")
    try:
        fleet.add(Endpoint("z", f"tcp://127.0.0.1:{pub.port}?replay=tcp://127.0.0.1:{pub.replay_port}", "kv-events"))
        # a chain of three blocks in two batches, the second under the first's last hash
        pub.send(0, [stored_map([11, 12], tokens=ids[:2 * BS], size=BS)])
        pub.send(1, [stored_map([13], parent=12, tokens=ids[2 * BS:], size=BS)])
        wait(lambda: len(fleet.engines["z"].contents()) == 3, 20, "the stream's blocks")
        ix = fleet.index()
        assert [c.cid for c in sorted(fleet.engines["z"].contents(), key=lambda c: c.server_hash)] == chain_ids(ids, BS)
        assert ix.duplicated_blocks() == 3 and ix.unknown_blocks() == 0
        assert ix.hash_disagreements() == 3 and "Warning" in ix.identity()
        z = next(r for r in fleet.rows() if r.name == "z")
        assert z.state == "live" and z.cached == 3 and z.gaps == 0
    finally:
        pub.close()


def test_a_typed_prompt_is_explained_on_each_engine_hit_evicted_elsewhere_nowhere_partial(pair):
    """Issue 26: the prompt box says, per engine, what of a prompt it would reuse and why not the
    rest: a KV-event stream that stored the system prompt's three blocks and removed the third
    (evicted, with the batch's time), a KVScope engine that holds them (hit), one that holds nothing
    (the system prompt is on the others), the question on no engine, the last block partial."""
    from app.fleet.index import why, why_words
    from tests.kv_event_stream import Publisher, frames, stored_map

    fleet, _ = pair
    run(fleet, "a", SYSTEM)
    ids = tokens(SYSTEM + " " + QUESTIONS[0])  # 71 tokens: 4 full blocks, the last partial
    pub = Publisher(topic=b"")
    try:
        fleet.add(Endpoint("z", f"tcp://127.0.0.1:{pub.port}?replay=tcp://127.0.0.1:{pub.replay_port}", "kv-events"))
        gone_at = time.time() - 30
        pub.send(0, [stored_map([11, 12, 13], tokens=ids[:3 * BS], size=BS)])
        pub.send(1, None, raw=frames(1, [{"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"}], ts=gone_at))
        wait(lambda: len(fleet.engines["z"].contents()) == 2 and fleet.engines["z"].evicted(), 20,
             "the stream's removal")
        ix = fleet.index()
        full, partial = (len(ids) - 1) // BS * BS, len(ids) - (len(ids) - 1) // BS * BS
        w = {name: why(ix, name, ids) for name in "abz"}
        assert (w["a"].hit, w["a"].missed) == (3 * BS, {"nowhere": full - 3 * BS, "partial_block": partial})
        rest = {"nowhere": full - 3 * BS, "partial_block": partial}  # the question, and the last block
        assert (w["b"].hit, w["b"].missed) == (0, {"elsewhere": 3 * BS, **rest})
        assert w["b"].elsewhere == ("a", "z")
        assert (w["z"].hit, w["z"].missed) == (2 * BS, {"evicted": BS, **rest})
        assert w["z"].evicted_at == pytest.approx(gone_at)
        for name in "abz":  # every token of the prompt: reused, or one reason
            assert w[name].hit + sum(w[name].missed.values()) == len(ids)
        assert why_words(w["z"], now=gone_at + 30) == (f"evicted {BS} (30 s ago) · on no engine {full - 3 * BS} · "
                                                       f"partial block {partial}")
        assert why_words(w["b"]).startswith(f"on a, z {3 * BS} · ")
        # a KVScope engine's own evictions, from its `evict` events: clear a's prefix cache
        assert fleet.engines["a"].clear_prefix_cache()
        wait(lambda: not fleet.engines["a"].contents(), 20, "a's cache cleared")
        w = why(fleet.index(), "a", ids)
        assert w.hit == 0 and w.missed["evicted"] == 3 * BS and w.evicted_at > gone_at
    finally:
        pub.close()
