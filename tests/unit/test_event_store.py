"""The history's packed event store reads like the list it replaces, and a history of more
events than its checkpoint budget holds still rebuilds the state at any retained event."""
from __future__ import annotations

import random

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState
from app.history.event_store import CHUNK, EventStore
from app.history.event_history import EventHistory
from tests.histories import busy_history


def test_the_store_reads_like_a_list_through_chunks_gaps_and_trims():
    rng = random.Random(3)
    store, plain, seq = EventStore(keep_decoded=2), [], 0
    for _ in range(5 * CHUNK + 123):
        seq += 1 if rng.random() > 0.001 else rng.randint(2, 50)  # a resync leaves a gap
        ev = p.Alloc(seq_id=f"s{seq % 7}", block_id=seq % 1000, logical_index=seq % 5, seq=seq, step=seq // 10)
        store.append(ev)
        plain.append(ev)
    for cut in (0, 17, CHUNK - 17, 2 * CHUNK + 5):
        del store[:cut]
        del plain[:cut]
        assert len(store) == len(plain) and list(store) == plain
        for i in [0, 1, -1, len(plain) // 2, *rng.sample(range(len(plain)), 30)]:
            assert store[i] == plain[i]
        for lo, hi in [(0, 10), (CHUNK - 5, CHUNK + 5), (len(plain) - 50, len(plain) + 10), (100, 3 * CHUNK)]:
            assert store[lo:hi] == plain[lo:hi]
        numbers = [e.seq for e in plain]
        for s in [0, numbers[0], numbers[-1], numbers[-1] + 1, *rng.sample(range(numbers[0], numbers[-1]), 40)]:
            want = next((i for i, n in enumerate(numbers) if n >= s), len(numbers))
            assert store.bisect_left(s) == want, s
    assert store.nbytes < 100 * len(store)


def test_prompt_texts_are_not_kept():
    store = EventStore()
    store.append(p.RequestAdded(request_id="r", seq_id="r", prompt_tokens=2, prompt_token_texts=["a", "b"], seq=1))
    assert store[0].prompt_token_texts is None


def test_a_history_thinned_to_its_budget_rebuilds_every_retained_event():
    h, d = busy_history(seed=11, ops=3000)
    first = PoolState.from_snapshot(d.first)
    small = EventHistory(d.first, max_events=2 * CHUNK, checkpoint_every=64,
                         checkpoint_bytes=8 * first.nbytes())
    truth = {}
    s = first.clone()
    for ev in d.events:
        small.append(ev)
        s.apply(ev)
        truth[ev.seq] = s.snapshot()
    assert len(d.events) > 2 * CHUNK and len(small.events) <= 2.2 * CHUNK
    assert len(small.checkpoints) <= 8 and small.checkpoint_every > 64
    for n in random.Random(5).sample(range(small.first_event, small.last_event + 1), 40):
        assert small.at(n).state.snapshot() == truth[n], n
