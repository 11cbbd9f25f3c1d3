"""The two prefix hit rates the header shows: KVScope's (every admission) and vLLM's definition
(first admissions only: vLLM's prefix_cache_queries / _hits leave out re-admissions after a
preemption). Issue 17, item 8; tests/vllm/test_vllm.py compares the second with vLLM's /metrics."""
from __future__ import annotations

import random

from kvscope_contract import protocol as p
from app.history.mirror import Mirror
from tests.pool_driver import PoolDriver

PREFIX = list(range(100, 164))


def test_first_admission_counts_leave_out_re_admissions_after_a_preemption():
    d = PoolDriver(p.PoolConfig(block_size=4, num_device_blocks=24, num_host_blocks=0, preemption_mode="recompute"))
    m = Mirror.from_snapshot(d.first)
    rng = random.Random(5)
    preempted: set[str] = set()
    first_hits = first_looked = 0
    for _ in range(1500):
        d.random_op(rng, [PREFIX], vocab=90)
        d.log.step += 1
        for ev in d.drain():
            # by hand: a sequence's admission is first unless it was preempted before
            looked = m.state.prefix_lookup(ev)
            sid = getattr(ev, "seq_id", None)
            if sid not in preempted:
                first_looked += looked
                first_hits += 4 * isinstance(ev, p.PrefixHit)
            if isinstance(ev, p.Preempt):
                preempted.add(ev.seq_id)
            m.apply(ev)
    tl = m.tally
    assert tl.recomputes > 0 and tl.hit_tokens > tl.first_hit_tokens > 0, "re-admissions hit"
    assert (tl.first_hit_tokens, tl.first_looked_up_tokens) == (first_hits, first_looked)
    assert tl.looked_up_tokens > tl.first_looked_up_tokens and 0 < tl.first_hit_rate <= 1
    clone = m.clone()
    assert clone.tally.preempted == tl.preempted and clone.tally.preempted is not tl.preempted
