"""KVScope's event stream as a prefix forest (kvscope_contract/prefix_forest.py), live and at any
past event.

Each `cached` event stores a node under its `parent_hash`, labelled with the text of the block's
tokens when the stream carries token texts; holders follow the reducer's ref counts, and the
order in which cached blocks lose their last holder is the allocator's eviction order. On a
hybrid pool a node is one hash with each KV-cache group's block (each group caches its own
under the same chained hash), and a request's hit counts once however many groups served it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.history.block_text import BlockTexts
from kvscope_contract import protocol as p
from kvscope_contract.prefix_forest import PrefixForest
from kvscope_contract.state import NULL, PoolState


@dataclass
class ForestBuilder:
    state: PoolState                 # the reducer, following the same events
    forest: PrefixForest = field(default_factory=PrefixForest)
    texts: BlockTexts = field(default_factory=BlockTexts)  # what each block's tokens say
    hits: dict[str, tuple[str, int]] = field(default_factory=dict)  # hash -> (sequence, step) of its last hit

    @classmethod
    def from_state(cls, state: PoolState, texts: BlockTexts | None = None) -> ForestBuilder:
        """Start from a state whose history is unknown: its cached blocks become roots (their
        parents were stored before this client saw the stream). `texts`: the dashboard's store,
        shared with its mirror (events replayed from history change nothing there); without it
        the builder keeps its own from the events it applies."""
        b = cls(state.clone(), texts=texts or BlockTexts(state.config.block_size, state.last_event))
        for block in np.flatnonzero(b.state.has_hash).tolist():
            b.forest.store(b.state.hash_of(block), None, block=block, holders=int(b.state.ref_counts[block]),
                           at=state.last_event, group=b._group(block))
        return b

    @property
    def last_event(self) -> int:
        return self.state.last_event

    def apply(self, ev: p.AnyEvent) -> None:
        pool, forest = self.state, self.forest
        if isinstance(ev, p.SwapOut):  # released tail first, as the allocator does (docs/protocol.md)
            order = list(dict.fromkeys(b for s in ev.group if s in pool.seqs for t in pool.seqs[s].block_tables
                                       for b in t if b != NULL))
            pool.apply(ev)
            for d in reversed(order):
                self._hold(d)
            return
        pool.apply(ev)
        self.texts.apply(ev, pool)
        match ev:
            case p.Fork():
                for t in ev.block_tables or [ev.block_ids]:
                    for b in t:
                        if b != NULL:
                            self._hold(b)
            case p.Cached():
                forest.store(ev.hash, ev.parent_hash, self._label(ev), block=ev.block_id,
                             holders=int(pool.ref_counts[ev.block_id]), at=ev.seq, group=self._group(ev.block_id))
            case p.PrefixHit():
                if self.hits.get(ev.hash) != (ev.seq_id, ev.step):  # one admission's groups hit it once
                    forest.hit(ev.hash)
                self.hits[ev.hash] = (ev.seq_id, ev.step)
                self._hold(ev.block_id)
            case p.Free() | p.WindowFree():
                self._hold(ev.block_id)
            case p.Cow():
                self._hold(ev.src_block_id)
            case p.SwapIn():  # joined a device block a sibling still held
                for _, d in ev.shared:
                    self._hold(d)
            case p.Evict():
                forest.remove(ev.hash, ev.kv_group if self.hybrid else None)
                self.hits.pop(ev.hash, None)
            case p.Reset():
                forest.clear()
                self.hits.clear()

    @property
    def hybrid(self) -> bool:
        return len(self.state.config.groups) > 1

    def _group(self, block: int) -> int | None:
        """The KV-cache group of a hashed block, on a hybrid pool (None on a one-group pool)."""
        return int(self.state.kv_group[block]) if self.hybrid else None

    def _hold(self, block: int) -> None:
        h = self.state.hash_of(block)
        if h is not None:
            self.forest.hold(h, int(self.state.ref_counts[block]), self._group(block))

    def _label(self, ev: p.Cached) -> str:
        """The start of the text of the block's tokens (from the sequence that filled it)."""
        return self.texts.by_hash.get(ev.hash) or self.texts.of_holder(self.state, ev.block_id, ev.seq_id) or ""
