"""Key events: the allocator decisions a teacher stops at (a prefix hit, a fork, a copy-on-write,
an eviction, a swap, a preemption), each explained in one line that names the blocks involved."""
from __future__ import annotations

from dataclasses import dataclass

from kvscope_contract import protocol as p
from kvscope_contract.kinds import KINDS, kind_of, touched_blocks, words
from kvscope_contract.state import PoolState
from app.derived.words import plural

KEY_KINDS = ("prefix_hit", "fork", "cow", "evict", "swap_out", "swap_in", "preempt")


@dataclass(frozen=True)
class KeyEvent:
    kind: str
    text: str          # one line, naming the blocks
    blocks: list[int]  # device blocks to highlight


def block_ranges(blocks: list[int]) -> str:
    """[26, 27, 28, 40] -> '26-28, 40'."""
    out: list[str] = []
    for b in sorted(set(blocks)):
        if out and b == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{b}"
        else:
            out.append(str(b))
    return ", ".join(out)


def _who(ev: p.SwapOut | p.SwapIn) -> str:
    return ev.seq_id if len(ev.group) == 1 else f"{', '.join(ev.group)} (samples of one request, together)"


def _copies(ev: p.SwapOut | p.SwapIn) -> str:
    """The copies a swap made, when sharing saved some: a shared block goes once."""
    if len(ev.group) == 1 and not ev.shared:
        return ""
    return (f"; {plural(len(ev.mapping), 'block')} copied, each shared block once"
            + (f", {len(ev.shared)} joined a copy already there" if ev.shared else ""))


def explain(step_events: list[p.AnyEvent], at: int, state: PoolState) -> KeyEvent | None:
    """The key event numbered `at` among `step_events` (every event of the step it belongs to:
    `EventHistory.step_events`), explained with the pool `state` after that step; events of the
    same kind and sequence are told together (a prefix hit: the whole admission's blocks)."""
    ev = next((e for e in step_events if e.seq == at), None)
    if ev is None or kind_of(ev) not in KEY_KINDS:
        return None
    kind, seq_id = kind_of(ev), getattr(ev, "seq_id", "")
    same = [e for e in step_events if kind_of(e) == kind and getattr(e, "seq_id", "") == seq_id]
    blocks = list(dict.fromkeys(b for e in same for b in touched_blocks(e)[0]))
    bs, refs = state.config.block_size, state.ref_counts
    ids = block_ranges(blocks)
    match ev:
        case p.Fork():
            n = max((refs[b] for b in ev.block_ids if b < len(refs)), default=1)
            text = (f"blocks {ids} now shared by {n} sequences: the fork of parallel sampling "
                    f"({ev.request_id}); no block was copied")
        case p.PrefixHit():  # the whole admission: every block its hit took, in every KV-cache group
            groups = len({e.kv_group for e in same})
            reach = max(e.logical_index for e in same) + 1  # the hit's tokens count once, however many groups
            text = (f"{seq_id} reuses {plural(len(blocks), 'cached block')} ({ids}) from the prefix cache"
                    + (f" in {groups} KV-cache groups" if groups > 1 else "")
                    + f": {reach * bs:,} prompt tokens it does not compute again")
        case p.Cow():
            text = (f"{seq_id} wrote into shared block {ev.src_block_id}: its own copy is block "
                    f"{ev.dst_block_id} (copy-on-write); {ev.src_block_id} stays with the other holders")
        case p.Evict():
            text = (f"{plural(len(same), 'cached block')} evicted ({ids}): the least recently used, "
                    "to make room for new blocks")
        case p.SwapOut():
            text = (f"{_who(ev)} swapped out to the host pool: device blocks {ids} → host blocks "
                    f"{block_ranges([h for _, h in ev.mapping + ev.shared])}, freed for the others{_copies(ev)}")
        case p.SwapIn():
            text = (f"{_who(ev)} swapped back in: host blocks "
                    f"{block_ranges([h for h, _ in ev.mapping + ev.shared])} → device blocks {ids}{_copies(ev)}")
        case p.Preempt():
            why = " (the host pool is full)" if ev.reason == "host_pool_full" else ""
            cost = ("its blocks go to the host pool" if ev.mode == "swap"
                    else "its blocks are freed and its tokens will be computed again")
            text = f"{seq_id} preempted by {ev.mode}{why}: the pool had no block for the next token; {cost}"
        case _:  # a key kind without a teacher's sentence yet: the event log's words
            text = words(ev)
    return KeyEvent(kind, f"{KINDS[kind].label}: {text}", blocks)
