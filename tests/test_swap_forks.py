"""Issue 17 item 10: the samples of one request, swapped out, copy the blocks they share once
and keep them shared on the host (host blocks with ref counts), come back shared, and give
the tokens of a run without preemption. The issue's reproduction: block size 1, 8 device
blocks, swap, "The cat sat", n=4, max 4 tokens, no chat template."""
from __future__ import annotations

import pytest

from engine.contract import protocol as p
from engine.contract.state import PoolState, check_invariants
from engine.sequence import SamplingParams
from tests.test_engine import make, tiny  # noqa: F401

PROMPT = "The cat sat"


def run(engine, params: SamplingParams):
    """Run the prompt to its end; the outputs by seq id, the events, and the reducer's state
    after every event (replayed from the first snapshot, checked at each swap)."""
    first = engine.snapshot()
    outs = {o.seq_id: o.token_ids for o in engine.generate([PROMPT], params)[0]}
    events = engine.log.drain()
    state, states = PoolState.from_snapshot(first), []
    for ev in events:
        state.apply(ev)
        if isinstance(ev, (p.SwapOut, p.SwapIn)):
            check_invariants(state)
            states.append((ev, state.clone()))
    assert state.snapshot() == engine.snapshot()
    return outs, events, states


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4, n=4, ignore_eos=True),
                                    SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=3, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_forked_samples_swap_their_shared_blocks_once_and_come_back_shared(tiny, params):
    roomy, _, _ = run(make(tiny, block_size=1, num_device_blocks=64, num_host_blocks=8), params)
    tight = make(tiny, block_size=1, num_device_blocks=8, num_host_blocks=8, preemption_mode="swap")
    outs, events, states = run(tight, params)
    assert outs == roomy  # greedy and seeded tokens as without preemption
    preempts = [e for e in events if isinstance(e, p.Preempt)]
    assert preempts and all(e.mode == "swap" for e in preempts)  # the host pool never ran out
    outs_, ins = [e for e, _ in states if isinstance(e, p.SwapOut)], [e for e, _ in states if isinstance(e, p.SwapIn)]
    assert any(len(e.group) > 1 for e in outs_)
    for ev, st in states:
        pairs = [a for a, _ in ev.mapping]
        assert len(pairs) == len(set(pairs))  # each block once
        group = [st.seqs[s] for s in ev.group]
        if isinstance(ev, p.SwapOut):
            # one host block per device block the group held: a shared block is copied once ...
            hosts = [h for s in group for h in s.host_table]
            assert sorted(set(hosts)) == sorted(h for _, h in ev.mapping)
            # ... and each host block's ref count is the number of group members holding it
            for h in set(hosts):
                assert st.host_ref_counts[h] == sum(h in s.host_table for s in group)
            if len(group) > 1:
                assert st.host_ref_counts.max() == len(group)  # the prompt's blocks, shared on the host
        else:  # back in: a host block the group shared is one device block they share again
            for h, d in ev.mapping:
                assert st.ref_counts[d] >= sum(d in s.block_table for s in group) >= 1
            if len(group) > 1:
                assert st.ref_counts[group[0].block_table[0]] >= len(group)
    # every block swapped out came back once: the same number of copies each way
    assert sum(len(e.mapping) for e in outs_) == sum(len(e.mapping) for e in ins)
    assert {s for e in outs_ for s in e.group} == {s for e in ins for s in e.group}
