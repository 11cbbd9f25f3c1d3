"""Trace replay and capacity sweep through the real scheduler and block manager (issue 35):
the ceiling reached exactly, the policies' order, the miss reasons adding up, a user's policy,
the command line's table, CSV and JSON. Slices of both Mooncake traces keep it fast."""
from __future__ import annotations

import io
import textwrap
from contextlib import redirect_stdout

import msgspec
import pytest

from kvscope_contract.lab import TRACE_REASONS, decode_sweep
from engine.core.eviction import LRU
from engine.lab.__main__ import main as lab_main
from engine.lab.trace import scan
from engine.lab.trace_replay import TraceLab
from engine.lab.trace_sweep import default_capacities, lab_config, model_bytes_per_token, sweep, unlimited_blocks
from tests.traces import ceiling_512, mooncake, req, write

SLICE = 300


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_an_unlimited_pool_one_at_a_time_reaches_the_ceiling_exactly(name):
    path = mooncake(name)
    hit, total = ceiling_512(path, SLICE)
    assert hit > 0
    s = sweep(path, [10**6], ["lru", "lfu", "opt"], requests=SLICE, one_at_a_time=True)
    for pt in s.points:
        assert (pt.hit_tokens, pt.looked_up_tokens) == (hit, total), pt.policy
        assert pt.evictions == 0 and pt.rejected == 0 and pt.finished == SLICE
    assert s.ceiling_hit_tokens == hit


def test_the_ceiling_at_a_smaller_block_size(tmp_path):
    """At 128-token blocks a repeated prompt also reuses the full 128-token blocks of its partial
    last 512-token block: 5 blocks of 128 where 512-token blocks reuse one."""
    path = write(tmp_path, [req(0, [0, 1], 700), req(1, [0, 1], 700), req(2, [0, 2])])
    for bs, hit in ((512, 512 + 512), (128, 640 + 512)):
        s = sweep(path, [10**4], ["lru"], one_at_a_time=True, block_size=bs)
        assert s.points[0].hit_tokens == s.ceiling_hit_tokens == hit, bs
    path = mooncake("conversation")
    s = sweep(path, [10**6], ["lru"], requests=100, one_at_a_time=True, block_size=128)
    assert s.points[0].hit_tokens == s.ceiling_hit_tokens >= ceiling_512(path, 100)[0]


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_opt_bounds_every_policy_and_grows_with_the_pool(name):
    path = mooncake(name)
    ix = scan(path, 512, SLICE)
    caps = [2 * ix.largest_request + 2, ix.blocks_needed // 8, ix.blocks_needed // 3, unlimited_blocks(ix)]
    s = sweep(path, caps, ["lru", "lfu", "opt"], requests=SLICE, one_at_a_time=True)
    rate = {(pt.policy, pt.blocks): pt.hit_tokens for pt in s.points}
    for cap in caps:
        assert rate["opt", cap] >= rate["lru", cap] and rate["opt", cap] >= rate["lfu", cap], cap
        assert max(rate[p, cap] for p in ("lru", "lfu", "opt")) <= s.ceiling_hit_tokens
    opt = [rate["opt", c] for c in caps]
    assert opt == sorted(opt) and opt[-1] == s.ceiling_hit_tokens
    assert rate["opt", caps[1]] > rate["lru", caps[1]]  # the gap the clairvoyant policy closes


def test_the_misses_add_up_by_reason():
    path = mooncake("conversation")
    s = sweep(path, [600, 10**6], ["lru"], requests=SLICE)  # arrivals at their timestamps
    for pt in s.points:
        assert sum(pt.missed.values()) == pt.looked_up_tokens - pt.hit_tokens
        assert set(pt.missed) == set(TRACE_REASONS)
        assert pt.missed["partial_block"] > 0 and pt.missed["cold"] > 0
    small, big = s.points
    assert small.missed["evicted"] > 0 == big.missed["evicted"] and small.evictions > 0


def test_waiting_arrivals_kept_as_lines_change_nothing():
    """With a few seats the queue grows long: holding arrivals back as file lines while it does
    makes the same decisions as queueing every one."""
    path = mooncake("conversation")
    ix = scan(path, 512, 400)
    rows = [TraceLab(lab_config(300, 512, max_num_seqs=4), ix, LRU(), step_ms=50, limit=400).run(hold=hold)
            for hold in (8, 10**9)]
    assert msgspec.to_builtins(rows[0]) == msgspec.to_builtins(rows[1])


def test_a_request_longer_than_the_pool_is_rejected(tmp_path):
    path = write(tmp_path, [req(0, [0, 1]), req(1, list(range(2, 30))), req(2, [0, 1, 40])])
    s = sweep(path, [12], ["lru"])
    assert s.points[0].rejected == 1 and s.points[0].finished == 2


def test_a_policy_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "mypolicies.py").write_text(textwrap.dedent('''
        from engine.core.eviction import EvictionPolicy

        class MRU(EvictionPolicy):
            """Most recently freed first."""
            popped = 0

            def __init__(self):
                self.stack = {}

            def push(self, block):
                self.stack[block] = None

            def remove(self, block):
                del self.stack[block]

            def pop(self):
                MRU.popped += 1
                return self.stack.popitem()[0]

            def __len__(self):
                return len(self.stack)

            def __iter__(self):
                return iter(reversed(self.stack))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = mooncake("conversation")
    s = sweep(path, [400], ["lru", "mypolicies:MRU"], requests=200, one_at_a_time=True)
    import mypolicies
    assert mypolicies.MRU.popped == s.points[1].evictions > 0
    assert s.points[1].policy == "MRU" and s.points[0].hit_tokens != s.points[1].hit_tokens
    with pytest.raises(ValueError, match="nosuch"):
        sweep(path, [400], ["nosuch.module:X"], requests=10)


def test_the_command_line_table_csv_and_json(tmp_path):
    path = mooncake("synthetic")
    out = io.StringIO()
    with redirect_stdout(out):
        assert lab_main([f"trace:{path}", "--requests", "150", "--sweep", "400,5000", "--policy", "lru,opt",
                         "--one-at-a-time", "--bytes-per-token", "327680", "--csv", str(tmp_path / "s.csv")]) == 0
    text = out.getvalue()
    assert "ceiling" in text and "one request at a time" in text
    lines = [line for line in text.splitlines() if line.startswith(("lru ", "opt "))]
    assert len(lines) == 4 and "5,000" in lines[-1] and "GiB" in lines[-1]
    csv_rows = (tmp_path / "s.csv").read_text().splitlines()
    assert csv_rows[0].startswith("policy,blocks,tokens,bytes,hit_rate") and len(csv_rows) == 5
    assert csv_rows[1].split(",")[3] == str(400 * 512 * 327680)
    out = io.StringIO()
    with redirect_stdout(out):
        assert lab_main([f"trace:{path}", "--requests", "50", "--sweep", "400", "--json", "--model", "smollm2"]) == 0
    s = decode_sweep(out.getvalue())
    assert s.requests == 50 and s.points[0].bytes == 400 * 512 * model_bytes_per_token("smollm2") == 400 * 512 * 23040
    err = io.StringIO()
    bad = write(tmp_path, [req(0, [0]), "{"])
    from contextlib import redirect_stderr
    with redirect_stderr(err):
        assert lab_main([f"trace:{bad}"]) == 2
    assert f"{bad}:2:" in err.getvalue()


def test_default_capacities_are_log_spaced_up_to_never_evicting():
    ix = scan(mooncake("conversation"), 512, 1000)
    caps = default_capacities(ix)
    assert len(caps) == 12 and caps == sorted(caps) and caps[-1] == unlimited_blocks(ix)
    assert caps[0] >= 2 * ix.largest_request


def test_a_host_tier_serves_what_the_device_evicted_at_the_same_device_size():
    """Device-only against device + host tier (issue 36) on a slice of the conversation trace, one
    request at a time: at the same device size a host tier turns evicted misses into host hits (this
    trace reuses a conversation's prefix long after: a tier of half the blocks the slice takes
    serves some), never more than the ceiling, the reasons still adding up; a tier as large as every
    block the slice takes serves every eviction, so the two tiers reach the ceiling together."""
    path = mooncake("conversation")
    ix = scan(path, 512, SLICE)
    small = 2 * ix.largest_request + 2
    s = sweep(path, [small], ["lru"], requests=SLICE, one_at_a_time=True,
              host_blocks=[0, unlimited_blocks(ix) // 2, unlimited_blocks(ix)])
    alone, some, ample = s.points
    assert alone.host_hit_tokens == 0 and alone.missed["evicted"] > 0
    assert alone.hit_tokens == some.hit_tokens == ample.hit_tokens  # the device's own hits do not change
    assert 0 < some.host_hit_tokens < ample.host_hit_tokens
    assert ample.hit_tokens + ample.host_hit_tokens == s.ceiling_hit_tokens and ample.missed["evicted"] == 0
    for pt in s.points:
        assert sum(pt.missed.values()) == pt.looked_up_tokens - pt.hit_tokens - pt.host_hit_tokens
    out = io.StringIO()
    with redirect_stdout(out):
        assert lab_main([f"trace:{path}", "--requests", "60", "--sweep", str(small), "--one-at-a-time",
                         "--host-blocks", "0,500"]) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("lru ")]
    assert len(rows) == 2 and "host tier" in out.getvalue() and rows[1].split()[-3] == "500"


def test_a_request_admitted_while_another_prefills_its_prefix_misses_it_in_flight(tmp_path):
    """Two requests share a 20-block prefix and arrive together. With the whole budget (8,192
    tokens) the first one's prefill takes every step until its last chunk, whose step admits the
    second with what is left: by then every shared block is registered, and it hits them all, so
    `in_flight` is 0. With a prefill capped at 2,048 tokens a step (vLLM's
    long_prefill_token_threshold), the second is admitted in the first step, when only the first
    chunk's 4 blocks are registered: it hits those and misses the other 15 shared blocks that the
    first request is still to compute, in flight."""
    ids = list(range(20))
    path = write(tmp_path, [req(0, ids), req(0, ids)])
    whole, capped = (sweep(path, [1000], ["lru"], long_prefill_token_threshold=cap).points[0] for cap in (0, 2048))
    assert whole.missed["in_flight"] == 0 and whole.hit_tokens == 19 * 512
    assert capped.hit_tokens == 4 * 512 and capped.missed["in_flight"] == 15 * 512
    assert sum(capped.missed.values()) == capped.looked_up_tokens - capped.hit_tokens


def test_in_flight_misses_on_a_mooncake_slice_with_capped_prefills():
    """On the synthetic trace's slice, with the prefill chunk capped at one block a step, requests
    are admitted while an earlier one still prefills the prefix they share: some misses are in
    flight. (The conversation trace's turns arrive after the turn before has answered: none there.)"""
    path = mooncake("synthetic")
    whole, capped = (sweep(path, [10**6], ["lru"], requests=SLICE, long_prefill_token_threshold=cap).points[0]
                     for cap in (0, 512))
    assert whole.missed["in_flight"] == 0 < capped.missed["in_flight"]
    assert capped.hit_tokens < whole.hit_tokens  # the pool never evicts: the in-flight misses are what it lost
    assert capped.missed["evicted"] == 0 and sum(capped.missed.values()) == capped.looked_up_tokens - capped.hit_tokens
