"""Issue 17 item 10: the samples of one request, swapped out, copy the blocks they share once
and keep them shared on the host (host blocks with ref counts), come back shared, and give
the tokens of a run without preemption. The issue's reproduction: block size 1, 8 device
blocks, swap, "The cat sat", n=4, max 4 tokens, no chat template."""
from __future__ import annotations

import pytest

from kvscope_contract import protocol as p
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from engine.core.sequence import SamplingParams
from tests.tiny_engine import make

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
        pairs = [a for a, _ in ev.mapping + ev.shared]
        assert len(pairs) == len(set(pairs))  # each block once
        group = [st.seqs[s] for s in ev.group]
        if isinstance(ev, p.SwapOut):
            # one host block per device block the group held: a shared block is copied once, or
            # not at all when a sibling swapped before left its copy there ...
            hosts = {h for s in group for h in s.host_table}
            assert hosts == {h for _, h in ev.mapping + ev.shared}
            # ... and each host block's ref count is the number of sequences holding it
            for h in hosts:
                assert st.host_ref_counts[h] == sum(h in s.host_table for s in st.seqs.values())
        else:  # back in: a host block they shared is one device block they share again
            for h, d in ev.mapping + ev.shared:
                assert st.ref_counts[d] >= sum(d in s.block_table for s in group) >= 1
            if len(group) > 1:
                assert st.ref_counts[group[0].block_table[0]] >= len(group)
    # the prompt's blocks were shared on the host by the three samples swapped out
    assert max(st.host_ref_counts.max() for _, st in states) >= 3
    # what was copied out came back: the same sequences, and never more copies than blocks
    assert {s for e in outs_ for s in e.group} == {s for e in ins for s in e.group}
    per_sample = sum(len(st.seqs[s].host_table) for e, st in states if isinstance(e, p.SwapOut) for s in e.group)
    assert sum(len(e.mapping) for e in outs_) < per_sample


def test_the_grid_draws_a_host_block_shared_by_a_fork_group_with_its_ref_count(tiny):
    from app.panels import grid
    from app.link.client import View
    from app.history.event_history import EventHistory

    engine = make(tiny, block_size=1, num_device_blocks=8, num_host_blocks=8, preemption_mode="swap")
    history = EventHistory(engine.snapshot(), checkpoint_every=16)
    engine.generate([PROMPT], SamplingParams(max_tokens=4, n=4, ignore_eos=True))
    for ev in engine.log.drain():
        history.append(ev)
    out = next(e for e in history.events if isinstance(e, p.SwapOut) and len(e.group) > 1)
    frame = grid.build(View(history.at(out.seq), False, 1, history.last_step_events(out.seq)), {})
    refs = frame.host["ref"]
    assert refs.max() == len(out.group) and (refs > 1).sum() >= 3  # the prompt's blocks, once each
    assert (frame.host["owner"][refs > 1] == 0).all()  # shared: drawn as shared, not as one sequence's
    assert (frame.host["owner"][refs == 1] != 0).all()
    assert frame.info["counts"]["host_used"] == int((refs > 0).sum())
