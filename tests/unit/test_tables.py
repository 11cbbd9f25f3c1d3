"""Block tables at scale, without a browser: runs of consecutive blocks either way, search and
the three orders over hundreds of sequences, cards that compress a long table and open it,
and the list that holds every sequence."""
from __future__ import annotations

import random
import re

from kvscope_contract import protocol as p
from app.panels import tables
from app.link.client import View
from app.history.event_history import EventHistory
from tests.pool_driver import PoolDriver


def test_runs_of_consecutive_blocks_rising_or_falling():
    assert tables.runs([]) == []
    assert tables.runs([7]) == [(0, 1)]
    assert tables.runs([1, 2, 3, 7, 6, 5, 4, 9, 11, 12, 20]) == [(0, 3), (3, 4), (7, 1), (8, 2), (10, 1)]
    table = [int(x) for x in random.Random(0).sample(range(10_000), 500)]
    flat = [table[i + j] for i, n in tables.runs(table) for j in range(n)]
    assert flat == table  # the runs cover the table in order


def many_sequences(count: int = 300) -> View:
    rng = random.Random(1)
    d = PoolDriver(p.PoolConfig(block_size=4, num_device_blocks=16_384, num_host_blocks=64))
    h = EventHistory(d.first)
    for i in range(count):
        seq = d.add([rng.randrange(50) for _ in range(rng.randint(2, 160))])
        if i % 3:
            d.admit(seq)
        for ev in d.drain():
            h.append(ev)
    return View(h.at(h.last_event), True, 1, [])


def test_search_and_the_three_orders():
    view = many_sequences()
    st = view.mirror.state
    everyone = tables.chosen(view)
    assert len(everyone) == len(st.seqs) == 300
    by_blocks = tables.chosen(view, sort="blocks held")
    assert [len(s.block_table) for s in by_blocks] == sorted((len(s.block_table) for s in by_blocks), reverse=True)
    assert [s.key for s in tables.chosen(view, sort="age")] == sorted(s.key for s in st.seqs.values())
    statuses = [s.status for s in tables.chosen(view, sort="status")]
    assert statuses == sorted(statuses, key=lambda x: tables.STATUS_ORDER[x]) and statuses[0] == "running"
    found = tables.chosen(view, "r12")
    assert {s.seq_id for s in found} == {s for s in st.seqs if "r12" in s} and len(found) == 11


def test_cards_compress_long_tables_and_the_list_holds_every_sequence():
    view = many_sequences()
    longest = tables.chosen(view, sort="blocks held")[:5]
    html = tables.render(view, {}, longest, pinned="r2")
    assert html.count('class="seq') == 6 and 'class="seq pin"' in html  # five cards and the pinned one
    s = longest[0]
    n = tables.runs(s.block_table)[0][1]
    assert n >= 3  # a run's chip names its ends; opened, the blocks follow it
    assert f"{s.block_table[0]}–{s.block_table[n - 1]}" in html and 'class="opened"' not in html
    assert not any(re.search(rf"</span>{blk}(<sup>|</span>)", html) for blk in s.block_table[1:n - 1])
    opened = tables.render(view, {}, longest, open_runs=True)
    assert all(re.search(rf"</span>{blk}(<sup>|</span>)", opened) for blk in s.block_table[:n])
    listing = tables.listing(view, tables.chosen(view))
    assert len(listing) == 300 and tables.LIST_COLUMNS[:3] == ["sequence", "status", "blocks"]
    assert {row[1] for row in listing} <= {"running", "waiting", "swapped"}


def test_a_few_sequences_are_all_cards():
    view = many_sequences(6)
    html = tables.render(view, {})
    assert html.count('class="seq') == 6


def test_a_short_table_shows_every_block_with_its_ref_count():
    """Runs are for long tables: a demo's eight blocks are eight chips, and `×n` is always a
    block's ref count (a run never borrows the mark)."""
    d = PoolDriver(p.PoolConfig(block_size=4, num_device_blocks=64, num_host_blocks=0))
    h = EventHistory(d.first)
    prompt = list(range(30))  # 8 blocks: 7 full ones are cached and shared by the second request
    for seq in (d.add(prompt), d.add(prompt)):
        d.admit(seq)
    for ev in d.drain():
        h.append(ev)
    view = View(h.at(h.last_event), True, 1, [])
    second = tables.chosen(view, sort="age")[1]
    html = tables.render(view, {}, [second])
    assert len(second.block_table) == 8 and 'class="ch run' not in html
    assert all(re.search(rf"</span>{blk}(<sup>×2</sup>)?(<span|</span>)", html) for blk in second.block_table)
    assert html.count("<sup>×2</sup>") == 7


def test_a_waiting_or_recomputed_sequence_shows_the_tokens_it_has_and_needs():
    """Issue 17 item 6: a waiting prompt of 120 tokens, and a sequence preempted by recompute
    with 96 tokens to compute again, say so (not '0 tokens = 0 prompt + 0 output')."""
    d = PoolDriver(p.PoolConfig(block_size=16, num_device_blocks=64, num_host_blocks=0,
                                enable_prefix_caching=False, preemption_mode="recompute"))
    h = EventHistory(d.first)
    waiting = d.add(list(range(120)), max_tokens=40)
    running = d.add(list(range(200, 280)), max_tokens=40)
    d.admit(running)
    for _ in range(15):
        d.decode(running)
    d.recompute(running)
    for ev in d.drain():
        h.append(ev)
    view = View(h.at(h.last_event), True, 1, [])
    html = tables.render(view, {})
    texts = {m.group(1): m.group(2) for m in re.finditer(r'class="id">([^<]+)</span>.*?class="meta">([^<]+)</span>',
                                                         html)}
    assert texts[waiting.seq_id] == ("0 of 120 tokens in the cache (120 prompt + 0 output, max 40) · 120 to compute · "
                                     "no blocks, needs 8 blocks of 16")
    assert texts[running.seq_id] == ("0 of 96 tokens in the cache (80 prompt + 16 output, max 40) · 96 to recompute · "
                                     "no blocks, needs 6 blocks of 16")


def test_a_search_that_matches_nothing_says_so_not_that_nothing_runs():
    """Issue 28: with 512 sequences live, a search that matched none said "No live sequence: submit a prompt"."""
    from tests.histories import busy_history, view_at
    from app.panels import tables
    h, _ = busy_history(seed=4, ops=300)
    view = view_at(h, h.last_event)
    live = len(view.mirror.state.seqs)
    assert live
    shown = tables.render(view, {}, tables.chosen(view, "no such sequence"))
    assert "submit a prompt" not in shown and f"None of the {live:,} live sequences matches" in shown
