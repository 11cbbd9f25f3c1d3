"""The dashboard's views of a hybrid pool (Gemma 3's shape: 5 sliding-window KV-cache groups, 1
full), against the reducer at every event of a busy history driven by the real block manager:
each sequence's card has a row per group (alike groups merged, every group on demand) naming
exactly its tables' blocks, the window's empty entries drawn as such; the grid's frame and hover
name a block's group; the header's numbers by group and what the windows save are the tables'
own counts. A one-group pool draws as it always did."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import gemma3_groups
from kvscope_contract.state import NULL
from app.history import groups
from app.link.client import View
from app.history.event_history import EventHistory
from app.panels import grid, header, tables
from tests.pool_driver import PoolDriver
from tests.histories import PREFIX, busy_history, view_at

BS, W = 4, 10  # a window of 10 tokens: blocks leave it every few tokens
CHIP = re.compile(r'title="logical (\d+) → physical block (\d+) · (\d+)/\d+ tokens')
EMPTY = re.compile(r'class="ch null"[^>]*title="logical (\d+)(?:–(\d+))?: no block')
ROW = re.compile(r'<div class="grp"><span class="gl" title="[^"]*">(.+?)</span><div class="chips">(.*?)</div></div>')


def hybrid_history() -> EventHistory:
    pool = p.PoolConfig(block_size=BS, num_device_blocks=160, num_host_blocks=48, kv_groups=gemma3_groups(W))
    return busy_history(11, 900, pool)[0]


@pytest.fixture(scope="module")
def history():
    return hybrid_history()


def rows_of(html: str) -> list[tuple[str, str]]:
    """(label, chips) of each row of the cards in `html`."""
    return [(label.replace("<br>", " · "), chips) for label, chips in ROW.findall(html)]


def test_the_history_shows_what_a_hybrid_pool_does(history):
    kinds = {type(ev).__name__ for ev in history.recent(history.last_event, 10**9)}
    assert {"WindowFree", "PrefixHit", "Cow", "Evict", "SwapOut", "SwapIn", "Fork"} <= kinds, kinds


def test_every_groups_row_names_exactly_its_tables_blocks_at_every_event(history):
    """With every group shown, row g of a card is group g's table entry for entry (a block's chip,
    or an empty chip for NULL); merged, each row stands for groups whose tables look alike and
    names the first one's blocks."""
    checked = merged = empty = 0
    for n in range(history.first_event, history.last_event + 1, 41):
        view = view_at(history, n)
        st = view.mirror.state
        for s in st.seqs.values():
            if not any(s.block_tables):
                continue
            every = rows_of(tables.render(view, {}, [s], every_group=True))
            assert [label for label, _ in every] == [groups.group_label(g, st.config.groups) for g in range(6)]
            for g, (_, chips) in enumerate(every):
                table = s.block_tables[g]
                named = {int(i): int(b) for i, b, _ in CHIP.findall(chips)}
                nulls = {j for a, b in EMPTY.findall(chips) for j in range(int(a), int(b or a) + 1)}
                runs_ = [(i, k) for i, k in tables.runs(table) if table[i] != NULL]
                if sum(k for _, k in runs_) <= tables.PLAIN:  # short enough: every block its own chip
                    assert named == {i: b for i, b in enumerate(table) if b != NULL}, (n, s.seq_id, g)
                    checked += len(named)
                assert nulls == {i for i, b in enumerate(table) if b == NULL}
                empty += len(nulls)
            compact = rows_of(tables.render(view, {}, [s]))
            assert len(compact) < 6 or len({tuple(t) for t in s.block_tables[:5]}) == 5
            for label, chips in compact:
                first = int(re.search(r"group[s]? (\d+)", label).group(1))
                named = {int(i): int(b) for i, b, _ in CHIP.findall(chips)}
                assert all(s.block_tables[first][i] == b for i, b in named.items())
                merged += "×" in label
    assert checked > 10_000 and empty > 10_000 and merged > 1000, (checked, empty, merged)


def test_the_windows_empty_entries_say_they_left_it_and_hits_are_marked_per_group():
    d = PoolDriver(p.PoolConfig(block_size=BS, num_device_blocks=200, num_host_blocks=0, kv_groups=gemma3_groups(W)))
    h = EventHistory(d.first)
    a = d.add(PREFIX)
    d.admit(a)
    for t in range(12):
        d.decode(a, t)
    b = d.add(PREFIX[:24] + [7, 8])  # 6 full blocks can hit: the full group from the start, a window its last
    d.admit(b)
    for ev in d.drain():
        h.append(ev)
    view = View(h.at(h.last_event), True, 1, [])
    origins = view.mirror.origins
    assert {i for (g, i), o in origins[b.seq_id].items() if g == 5 and o == "prefix_hit"} == set(range(6))
    sliding_hits = {i for (g, i), o in origins[b.seq_id].items() if g == 0 and o == "prefix_hit"}
    assert sliding_hits and max(sliding_hits) == 5 and 0 not in sliding_hits  # only the blocks its window reads
    assert {i for (g, i), o in origins[a.seq_id].items() if g == 0 and o == "window_free"} == \
        {i for i, x in enumerate(a.block_tables[0]) if x == NULL}
    html = tables.render(view, {}, [view.mirror.state.seqs[a.seq_id]])
    (label_s, sliding), (label_f, full) = rows_of(html)
    assert label_s == f"groups 0–4 · sliding {W} ×5" and label_f == "group 5 · full"
    assert "left the window: freed as it moved" in sliding and 'class="ch null"' not in full
    hit = tables.render(view, {}, [view.mirror.state.seqs[b.seq_id]])
    assert "outside the window when the sequence was admitted" in hit  # a hit skipped them: never held


def test_a_one_group_pool_draws_as_it_always_did():
    d = PoolDriver(p.PoolConfig(block_size=BS, num_device_blocks=64, num_host_blocks=0))
    h = EventHistory(d.first)
    for seq in (d.add(PREFIX), d.add(PREFIX)):
        d.admit(seq)
    for ev in d.drain():
        h.append(ev)
    view = View(h.at(h.last_event), True, 1, [])
    html = tables.render(view, {})
    assert 'class="grp"' not in html and "KV-cache group" not in html and html.count('<div class="chips">') == 2
    assert "groups" not in grid.build(view, {}).info and not view.mirror.usage()["kinds"]


def test_the_grid_frame_and_hover_name_a_blocks_group(history):
    for n in range(history.last_event, history.first_event, -1):
        view = view_at(history, n)
        st = view.mirror.state
        held = np.flatnonzero((st.ref_counts > 0) & (st.kv_group > 0))
        if len(held) > 20:
            break
    frame = grid.build(view, {})
    assert (frame.dev["group"] == st.kv_group).all()
    names = [g[0] for g in frame.info["groups"]]
    assert names == [groups.group_label(g, st.config.groups) for g in range(6)]
    states = st.block_states()
    for g, (_, _, used, cached) in enumerate(frame.info["groups"]):
        assert used == int(((states == 2) | (states == 3))[st.kv_group == g].sum())
        assert cached == int((states == 1)[st.kv_group == g].sum())
    head, parts = grid.read(grid.message(frame, None))
    assert (parts["dev"]["group"] == st.kv_group).all() and head["groups"] == frame.info["groups"]
    for b in held[:20].tolist():
        g = int(st.kv_group[b])
        info = grid.focus(view, b, False, {})
        want = sorted((s.seq_id, s.block_tables[g].index(b)) for s in st.seqs.values() if b in s.block_tables[g])
        assert info["group"] == g and sorted((x[0], x[2]) for x in info["holders"]) == want and want


def test_the_header_counts_each_kind_of_group_and_what_the_windows_save(history):
    for n in range(history.first_event, history.last_event + 1, 37):
        view = view_at(history, n)
        st, bs = view.mirror.state, BS
        u = view.mirror.usage()
        sliding, full = u["kinds"]
        assert (sliding.groups, full.groups) == ((0, 1, 2, 3, 4), (5,)) and sliding.label == f"sliding {W} ×5"
        for k in (sliding, full):  # blocks some table of these groups names, a shared one once
            blocks = {b for s in st.seqs.values() for g in k.groups for b in s.block_tables[g] if b != NULL}
            assert k.used == len(blocks) and k.slots == len(blocks) * bs
            assert k.tokens == int(st.tokens[list(blocks)].sum()) if blocks else k.tokens == 0
        assert sliding.used + full.used == u["used"]
        holding = [s for s in st.seqs.values() if s.holds_blocks()]
        assert full.reserved == sum(s.prompt_tokens + s.max_tokens for s in holding)
        assert sliding.reserved == 5 * sum(min(s.prompt_tokens + s.max_tokens, W) for s in holding)
        assert u["reserved_slots"] == sliding.reserved + full.reserved
        assert u["full_everywhere"] == 6 * full.used  # every group holding what the full one does
        line = header.groups_line(u, st.config)
        assert f"<b>sliding {W} ×5</b> (groups 0–4): {sliding.used:,} used" in line
        assert f"<b>full</b> (group 5): {full.used:,} used" in line
        if u["holding"] and 6 * full.used > u["used"]:
            card = header.by_group(u, st.config)
            assert f"would hold <b>{6 * full.used:,} blocks</b>" in card
            assert f"they save <b>{6 * full.used - u['used']:,} block" in card
