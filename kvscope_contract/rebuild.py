"""Prompts rebuilt from block hashes, for streams whose `request_added` carries no token ids
(recordings made before the protocol sent them, such as the bundled demo).

What the events show of a prompt is the chain hash of each full block it holds (its
`prefix_hit`s, and the `cached` events of the blocks it computed). Stand-in token ids that are
equal exactly where those hashes are equal keep every prefix the prompts share in whole
blocks; finer sharing (two prompts that part inside a block) is lost, and the blocks no hash
names are unique. The lab replays such recordings with them (engine/lab/workload.py), and the
miss explainer reads them (kvscope_contract/misses.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState

STAND_IN = 1 << 31  # stand-in tokens lie above any vocabulary, and within 32 bits (content ids)


def known_prompt(ev: p.RequestAdded) -> bool:
    """Whether the event carries its prompt's token ids."""
    return ev.prompt_token_ids is not None and len(ev.prompt_token_ids) == ev.prompt_tokens


@dataclass
class PromptRebuilder:
    """Folds the events (`observe`, with the pool just before each) and collects, per request,
    the chain hash of each of its prompt's full blocks that the events name."""
    hashes: dict[str, dict[int, str]] = field(default_factory=dict)  # request -> logical index -> hash
    request_of: dict[str, str] = field(default_factory=dict)          # seq_id -> request
    block_sizes: dict[str, int] = field(default_factory=dict)         # request -> its pool's block size

    def observe(self, ev: p.AnyEvent, before: PoolState) -> None:
        match ev:
            case p.RequestAdded():
                self.request_of[ev.seq_id] = ev.request_id
                self.hashes.setdefault(ev.request_id, {})
                self.block_sizes[ev.request_id] = before.config.block_size
            case p.Fork() if ev.parent_seq_id in self.request_of:
                self.request_of[ev.seq_id] = self.request_of[ev.parent_seq_id]
            case p.PrefixHit() if ev.seq_id in self.request_of:
                self.hashes[self.request_of[ev.seq_id]].setdefault(ev.logical_index, ev.hash)
            case p.Cached():
                for s in before.seqs.values():  # every holder: a fork's samples name their request too
                    if s.seq_id in self.request_of and ev.block_id in s.block_table:
                        self.hashes[self.request_of[s.seq_id]].setdefault(s.block_table.index(ev.block_id), ev.hash)

    def prompt(self, request_id: str, length: int) -> list[int]:
        """Stand-in token ids for the request's prompt of `length` tokens: equal chain hashes give
        equal blocks (so equal prefixes), the rest unique."""
        bs, hashes, out = self.block_sizes.get(request_id, 16), self.hashes.get(request_id, {}), []
        for i in range(-(-length // bs)):
            h = hashes.get(i)
            key = h if h is not None and (i + 1) * bs <= length else f"{request_id}/{i}"
            out += [STAND_IN + (hash((key, j)) & (STAND_IN - 1)) for j in range(min(bs, length - i * bs))]
        return out


def with_rebuilt_prompts(start: p.Snapshot | PoolState, events: list[p.AnyEvent]) -> tuple[list[p.AnyEvent], int]:
    """`events` (which follow `start`, one by one) with every `request_added` that lacks its
    prompt's token ids given rebuilt ones; and how many were rebuilt. Events that have them pass
    unchanged."""
    if all(known_prompt(ev) for ev in events if isinstance(ev, p.RequestAdded)):
        return events, 0
    state = start.clone() if isinstance(start, PoolState) else PoolState.from_snapshot(start)
    rebuilder = PromptRebuilder()
    for ev in events:
        if ev.seq > state.last_event:
            rebuilder.observe(ev, state)
            state.apply(ev)
    out, rebuilt = [], 0
    for ev in events:
        if isinstance(ev, p.RequestAdded) and not known_prompt(ev):
            ev = msgspec.structs.replace(ev, prompt_token_ids=rebuilder.prompt(ev.request_id, ev.prompt_tokens))
            rebuilt += 1
        out.append(ev)
    return out, rebuilt
