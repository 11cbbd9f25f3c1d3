"""Random operation sequences over small pools: invariants 2-4 after every operation, and
replaying every event so far onto the first snapshot equals the manager's own (invariant 1)."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, settings, strategies
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.contract import protocol as p
from engine.sequence import SeqStatus
from engine.contract.state import PoolState, check_invariants
from tests.pool_driver import PoolDriver

PREFIXES = [[1, 2, 3, 4] * 8, [5, 6] * 16, [7] * 32]


class PoolMachine(RuleBasedStateMachine):
    @initialize(block_size=strategies.sampled_from([1, 4, 16]), num_blocks=strategies.integers(4, 24),
                num_host=strategies.integers(0, 12), caching=strategies.booleans())
    def setup(self, block_size: int, num_blocks: int, num_host: int, caching: bool) -> None:
        self.d = PoolDriver(p.PoolConfig(block_size=block_size, num_device_blocks=num_blocks,
                                         num_host_blocks=num_host, enable_prefix_caching=caching))
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

    @rule(data=strategies.data())
    def swap_out(self, data) -> None:
        seq = self.pick(data, SeqStatus.RUNNING)
        if seq is not None and self.d.bm.can_swap_out(seq):
            self.d.swap_out(seq)

    @rule(data=strategies.data())
    def swap_in(self, data) -> None:
        seq = self.pick(data, SeqStatus.SWAPPED)
        if seq is not None and self.d.bm.can_swap_in(seq):
            table = list(seq.host_table)
            mapping = self.d.swap_in(seq)
            assert [h for h, _ in mapping] == table  # logical order restored

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


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_random_trace_of_100k_operations_replays_to_the_snapshot():
    rng = random.Random(1234)
    d = PoolDriver(p.PoolConfig(block_size=4, num_device_blocks=64, num_host_blocks=32))
    for _ in range(100_000):
        d.random_op(rng, PREFIXES)
    d.drain()
    kinds = {ev.__struct_config__.tag for ev in d.events}
    assert {"prefix_hit", "cached", "evict", "cow", "swap_out", "swap_in", "fork"} <= kinds
    assert d.replay().snapshot() == d.snapshot()
    assert [ev.seq for ev in d.events] == list(range(1, len(d.events) + 1))
