"""Random operation sequences over small pools: invariants 2-4 after every operation, and
replaying every event so far onto the first snapshot equals the manager's own (invariant 1)."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings, strategies
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvscope_contract import protocol as p
from engine.core.sequence import SeqStatus
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from tests.pool_driver import PoolDriver

PREFIXES = [[1, 2, 3, 4] * 8, [5, 6] * 16, [7] * 32]


def hybrid(block_size: int, windows: list[int | None]) -> list[p.KVGroup]:
    """KV-cache groups of one layer each: a sliding window of `w` blocks' worth (+ a few tokens),
    or full attention for None."""
    return [p.KVGroup(kind="full_attention", layers=[i]) if w is None else
            p.KVGroup(kind="sliding_window", sliding_window=w, layers=[i]) for i, w in enumerate(windows)]


# one group (every protocol-1 pool), and hybrids: a window with full attention (Gemma's kinds),
# two groups of one window with full attention, two windows, and a window alone (Mistral's kind)
LAYOUTS = [[], [2, None], [2, 2, None], [1, 3, None], [2]]


class PoolMachine(RuleBasedStateMachine):
    @initialize(block_size=strategies.sampled_from([1, 4, 16]), num_blocks=strategies.integers(4, 24),
                num_host=strategies.integers(0, 12), caching=strategies.booleans(),
                layout=strategies.sampled_from(LAYOUTS), extra=strategies.integers(0, 3))
    def setup(self, block_size: int, num_blocks: int, num_host: int, caching: bool, layout: list,
              extra: int) -> None:
        windows = [None if w is None else w * block_size + extra for w in layout]
        groups = hybrid(block_size, windows) if layout else []
        self.d = PoolDriver(p.PoolConfig(block_size=block_size, num_device_blocks=max(num_blocks, 2 * len(groups)),
                                         num_host_blocks=num_host, enable_prefix_caching=caching,
                                         kv_groups=groups))
        self.replayed = PoolState.from_snapshot(self.d.first)

    def pick(self, data, status: SeqStatus):
        seqs = self.d.with_status(status)
        return data.draw(strategies.sampled_from(seqs)) if seqs else None

    @rule(prefix=strategies.sampled_from(range(len(PREFIXES))), cut=strategies.integers(0, 32),
          tail=strategies.lists(strategies.integers(0, 3), max_size=20))
    def add(self, prefix: int, cut: int, tail: list[int]) -> None:
        tokens = PREFIXES[prefix][:cut] + tail
        if tokens:
            self.d.admit(self.d.add(tokens))

    @rule(data=strategies.data(), token=strategies.integers(0, 3))
    def decode(self, data, token: int) -> None:
        seq = self.pick(data, SeqStatus.RUNNING)
        if seq is not None and self.d.bm.can_append(seq):
            self.d.decode(seq, token)

    @rule(data=strategies.data())
    def admit_waiting(self, data) -> None:
        seq = self.pick(data, SeqStatus.WAITING)
        if seq is not None:
            self.d.admit(seq)

    @rule(data=strategies.data())
    def fork(self, data) -> None:
        seq = self.pick(data, SeqStatus.RUNNING)
        if seq is not None:
            self.d.fork(seq)

    @rule(data=strategies.data(), reason=strategies.sampled_from(["stop", "abort"]))
    def finish(self, data, reason) -> None:
        seqs = list(self.d.seqs.values())
        if seqs:
            self.d.finish(data.draw(strategies.sampled_from(seqs)), reason)

    def group(self, data, status: SeqStatus):
        """A sequence of `status` alone, or with some or all of its request's others (forks)."""
        seq = self.pick(data, status)
        if seq is None:
            return []
        family = self.d.family(seq, status)
        return data.draw(strategies.sampled_from([[seq], family, family[:2]]))

    @rule(data=strategies.data())
    def swap_out(self, data) -> None:
        group = self.group(data, SeqStatus.RUNNING)
        if group and self.d.bm.can_swap_out(group):
            tables = [[list(t) for t in s.block_tables] for s in group]
            distinct = list(dict.fromkeys(b for ts in tables for t in ts for b in t if b != p.NULL_BLOCK))
            self.d.swap_out(group)
            ev = self.d.log.pending[-1]
            pairs = ev.mapping + ev.shared
            assert sorted(d for d, _ in pairs) == sorted(distinct)  # a shared block once
            to_host = {**dict(pairs), p.NULL_BLOCK: p.NULL_BLOCK}
            assert [s.host_tables for s in group] == [[[to_host[b] for b in t] for t in ts] for ts in tables]

    @rule(data=strategies.data())
    def swap_in(self, data) -> None:
        group = self.group(data, SeqStatus.SWAPPED)
        if group and self.d.bm.can_swap_in(group):
            tables = [[list(t) for t in s.host_tables] for s in group]
            self.d.swap_in(group)
            ev = self.d.log.pending[-1]
            pairs = ev.mapping + ev.shared
            to_device = {**dict(pairs), p.NULL_BLOCK: p.NULL_BLOCK}
            held = {h for ts in tables for t in ts for h in t if h != p.NULL_BLOCK}
            assert sorted(h for h, _ in pairs) == sorted(held)
            assert [s.block_tables for s in group] == [[[to_device[h] for h in t] for t in ts] for ts in tables]

    @rule(data=strategies.data())
    def recompute(self, data) -> None:
        seq = self.pick(data, SeqStatus.RUNNING)
        if seq is not None:
            self.d.recompute(seq)

    @rule()
    def clear(self) -> None:
        self.d.bm.clear_prefix_cache()

    @invariant()
    def replay_matches(self) -> None:
        if not hasattr(self, "d"):
            return
        for ev in self.d.drain():
            self.replayed.apply(ev)
        check_invariants(self.replayed)
        assert self.replayed.snapshot() == self.d.snapshot()
        free, cached, used, *_ = self.replayed.counts()
        assert free + cached + used == self.d.bm.config.num_device_blocks
        assert free + cached == self.d.bm.num_allocatable_blocks
        assert self.replayed.host_ref_counts.tolist() == self.d.bm.host.ref_counts
        assert len(self.d.bm.host.free) == self.d.bm.host.ref_counts.count(0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("layout", [[], [3, None]], ids=["one group", "hybrid"])
def test_random_trace_of_100k_operations_replays_to_the_snapshot(layout):
    rng = random.Random(1234)
    groups = hybrid(4, [None if w is None else w * 4 + 1 for w in layout]) if layout else []
    d = PoolDriver(p.PoolConfig(block_size=4, num_device_blocks=64, num_host_blocks=32, kv_groups=groups))
    for _ in range(100_000):
        d.random_op(rng, PREFIXES)
    d.drain()
    kinds = {ev.__struct_config__.tag for ev in d.events}
    assert {"prefix_hit", "cached", "evict", "cow", "swap_out", "swap_in", "fork"} <= kinds
    if layout:
        assert "window_free" in kinds
    swaps = [ev for ev in d.events if isinstance(ev, (p.SwapOut, p.SwapIn))]
    assert any(len(ev.group) > 1 for ev in swaps)  # forks swapped together
    assert any(ev.shared for ev in swaps if isinstance(ev, p.SwapOut))  # joining a sibling's host copy
    assert any(ev.shared for ev in swaps if isinstance(ev, p.SwapIn))   # ... and its device copy
    assert d.replay().snapshot() == d.snapshot()
    assert [ev.seq for ev in d.events] == list(range(1, len(d.events) + 1))
