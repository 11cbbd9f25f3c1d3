"""The grid's frames and deltas, without a browser: every block's drawing agrees with the
reducer's helpers, a delta applied to the frame it starts from gives the new frame exactly,
the hover says who holds a block and what its tokens read, and a step that names blocks of a
pool since shrunk never breaks a frame."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvscope_contract import protocol as p
from kvscope_contract.kinds import TOUCH_KINDS
from app.panels import grid
from app.link.client import View
from app.history.event_history import EventHistory
from tests.pool_driver import PoolDriver
from tests.histories import PREFIX, busy_history, view_at


@pytest.fixture(scope="module")
def history():
    return busy_history()


def test_the_busy_history_shows_every_mechanism(history):
    h, _ = history
    kinds = {e.__struct_config__.tag for e in h.events}
    assert {"prefix_hit", "fork", "cow", "swap_out", "swap_in", "preempt", "evict", "finish"} <= kinds


def test_a_frame_draws_what_the_reducer_says(history):
    h, _ = history
    for n in random.Random(1).sample(range(h.first_event, h.last_event + 1), 60):
        view = view_at(h, n)
        frame = grid.build(view, {})
        st = view.mirror.state
        dev_tokens, host_tokens = st.block_tokens()
        assert frame.dev["state"].tolist() == st.block_states().tolist()
        assert frame.dev["ref"].tolist() == st.ref_counts.tolist()
        assert frame.dev["tokens"].tolist() == dev_tokens.tolist()
        assert frame.host["tokens"].tolist() == host_tokens.tolist()
        for b in range(len(st.ref_counts)):
            holders = [s for s in st.seqs.values() if b in s.block_table]
            # one holder: its key, which the frame's sequence table names; shared: no single owner
            want = frame.seqs[frame.dev["owner"][b]][0] if frame.dev["owner"][b] else None
            assert want == (holders[0].seq_id if len(holders) == 1 else None), (n, b)
            if digits := st.hash_of(b):
                assert frame.dev["hash"][b] == int(digits[:8], 16)
        owners = [frame.seqs[k][0] if k else None for k in frame.host["owner"].tolist()]
        holders = st.host_first_holders()
        assert owners == [o if r == 1 else None for o, r in zip(holders, st.host_ref_counts.tolist())]
        assert frame.host["ref"].tolist() == st.host_ref_counts.tolist()
        dev_touch, host_touch = grid.touched(view.step_events)
        assert set(np.flatnonzero(frame.dev["touch"]).tolist()) == set(dev_touch)
        assert frame.info["counts"] == st.counts()._asdict()


def apply(held: dict, data: bytes) -> dict:
    """What assets/grid.js does with a message, in numpy: the columns it then holds."""
    head, parts = grid.read(data)
    if head["kind"] == "full":
        return {"token": head["token"], "dev": parts["dev"].copy(), "host": parts["host"].copy(),
                "seqs": {k: v for k, *v in head["seqs"]}}
    assert head["base"] == held["token"]
    dev, host = held["dev"].copy(), held["host"].copy()
    if "devIdx" in parts:
        dev[parts["devIdx"]] = parts["dev"]
        host[parts["hostIdx"]] = parts["host"]
    seqs = {k: v for k, v in held["seqs"].items() if k not in head["gone"]} | {k: v for k, *v in head["seqs"]}
    return {"token": head["token"], "dev": dev, "host": host, "seqs": seqs}


def test_deltas_from_any_frame_rebuild_the_next_exactly(history):
    h, _ = history
    rng = random.Random(2)
    points = sorted(rng.sample(range(h.first_event, h.last_event + 1), 80))
    frames = [grid.build(view_at(h, n), {}) for n in points]
    held = apply({}, grid.message(frames[0], None))
    for i in range(1, len(frames)):
        base = frames[rng.randrange(0, i)] if rng.random() < 0.3 else frames[i - 1]  # travel back, too
        held_base = apply({}, grid.message(base, None))
        data = grid.message(frames[i], base)
        assert grid.read(data)[0]["kind"] == "delta"
        held = apply(held_base, data)
        assert held["dev"].tobytes() == frames[i].dev.records().tobytes()
        assert held["host"].tobytes() == frames[i].host.records().tobytes()
        assert held["seqs"] == frames[i].seqs
    same = grid.read(grid.message(frames[-1], frames[-1]))
    assert same[0]["kind"] == "delta" and "devIdx" not in same[1]  # nothing new: nothing sent


def test_a_delta_carries_only_what_changed(history):
    h, _ = history
    a, b = (grid.build(view_at(h, n), {}) for n in (h.last_event - 40, h.last_event))
    head, parts = grid.read(grid.message(b, a))
    changed = np.flatnonzero(a.dev.records() != b.dev.records())
    assert parts["devIdx"].tolist() == changed.tolist() and len(changed) < b.shape[0]


def test_another_pool_size_or_an_unknown_base_gets_the_whole_frame(history):
    h, _ = history
    frame = grid.build(view_at(h, h.last_event), {})
    other = grid.build(View(EventHistory(PoolDriver(p.PoolConfig(num_device_blocks=12)).first).live,
                            True, 1, []), {})
    assert grid.read(grid.message(frame, other))[0]["kind"] == "full"
    assert grid.read(grid.message(frame, None))[0]["kind"] == "full"
    grid.FRAMES.add(frame)
    assert grid.FRAMES.get(frame.token) is frame and grid.FRAMES.get("nonsense") is None


def test_big_whole_frames_travel_deflated():
    d = PoolDriver(p.PoolConfig(num_device_blocks=1 << 16, num_host_blocks=1 << 12))
    frame = grid.build(View(EventHistory(d.first).live, True, 1, []), {})
    data = grid.message(frame, None)
    head, parts = grid.read(data)
    assert head["deflated"] and len(data) < frame.nbytes / 20
    assert parts["dev"].tobytes() == frame.dev.records().tobytes()


def test_a_step_naming_blocks_outside_the_pool_never_breaks_a_frame():
    """A view's step events may come from before a reset to a smaller pool (issue 8, bug 1)."""
    d = PoolDriver(p.PoolConfig(num_device_blocks=12, num_host_blocks=2))
    stale = [p.Alloc(seq_id="r1", block_id=200, logical_index=0), p.SwapOut(seq_id="r1", mapping=[(150, 9)])]
    frame = grid.build(View(EventHistory(d.first).live, True, 1, stale), {})
    assert not frame.dev["touch"].any() and not frame.host["touch"].any() and frame.shape[0] == 12


def test_hover_names_every_holder_and_the_blocks_text(history):
    h, _ = history
    for n in range(h.last_event, h.first_event, -1):  # the latest moment with a shared block
        view = view_at(h, n)
        st = view.mirror.state
        shared = np.flatnonzero(st.ref_counts >= 2)
        if len(shared):
            break
    b = int(shared[0])
    info = grid.focus(view, b, False, {})
    holders = sorted(s.seq_id for s in st.seqs.values() if b in s.block_table)
    assert sorted(x[0] for x in info["holders"]) == holders and len(holders) >= 2
    sid, index = info["holders"][0][0], info["holders"][0][2]
    assert st.seqs[sid].block_table[index] == b
    assert info["text"] and info["text"].startswith("<")  # the prompt's token texts, joined per block
    assert grid.focus(view, 10_000, False, {}) is None


def test_cached_blocks_keep_their_text_after_their_holder_finishes(history):
    h, _ = history
    view = view_at(h, h.last_event)
    st = view.mirror.state
    cached = [b for b in np.flatnonzero(st.has_hash & (st.ref_counts == 0)).tolist()]
    assert cached
    texts = [grid.focus(view, b, False, {})["text"] for b in cached]
    assert sum(t is not None for t in texts) >= len(cached) // 2
    assert all(t.startswith("<") for t in texts if t)


def test_the_legend_counts_events_and_the_blocks_they_outline(history):
    h, _ = history
    for n in range(h.last_event, h.first_event, -1):
        view = view_at(h, n)
        if any(isinstance(e, p.Cow) for e in view.step_events):
            break
    info = grid.build(view, {}).info
    cows = sum(isinstance(e, p.Cow) for e in view.step_events)
    events, blocks = info["touched"]["cow"]
    assert events == cows and blocks >= cows  # each copy outlines its source and its copy
    assert set(info["touched"]) <= set(TOUCH_KINDS)


@pytest.mark.parametrize("config", [p.PoolConfig(block_size=4, num_device_blocks=24, num_host_blocks=0),
                                    p.PoolConfig(block_size=4, num_device_blocks=1, num_host_blocks=1),
                                    p.PoolConfig(block_size=4, num_device_blocks=1, num_host_blocks=0)],
                         ids=["no-host-blocks", "one-block", "one-block-no-host"])
def test_deltas_over_many_frames_of_a_pool_without_host_blocks_or_of_one_block(config):
    """Issue 17, item 1: a pool with no host blocks (every vLLM pool) or a single block drew its
    first frame, then failed on every delta. Each frame of a run, as the browser pulls them."""
    rng = random.Random(3)
    d = PoolDriver(config)
    h = EventHistory(d.first, checkpoint_every=50)
    for _ in range(300):
        d.random_op(rng, [PREFIX], vocab=90)
        d.log.step += 1
        for ev in d.drain():
            h.append(ev)
    assert h.last_event - h.first_event > 100, "the run did something"
    frames = [grid.build(view_at(h, n), {}) for n in range(h.first_event, h.last_event + 1)]
    held = apply({}, grid.message(frames[0], None))
    for base, frame in zip(frames, frames[1:]):
        held = apply(held, grid.message(frame, base))
        assert held["dev"].tobytes() == frame.dev.records().tobytes()
        assert held["host"].tobytes() == frame.host.records().tobytes()
    assert len(held["host"]) == config.num_host_blocks and len(held["dev"]) == config.num_device_blocks


def test_the_grid_publishes_what_it_drew_only_when_the_tests_ask(monkeypatch):
    """Shipped JavaScript keeps its test hooks (window.__kvscope_*) off unless the app runs with
    KVSCOPE_TEST_HOOKS=1, as tools/launch.py starts it for a driven browser."""
    from app.streamlit_argv import TEST_HOOKS
    monkeypatch.delenv(TEST_HOOKS, raising=False)
    assert "data-test-hooks" not in grid._html()
    monkeypatch.setenv(TEST_HOOKS, "1")
    assert "data-test-hooks" in grid._html()
