"""KVScope's event stream as a prefix forest (engine/contract/prefix_forest.py), live and at any
past event.

Each `cached` event stores a node under its `parent_hash`, labelled with the text of the block's
tokens when the stream carries token texts; holders follow the reducer's ref counts, and the
order in which cached blocks lose their last holder is the allocator's eviction order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.contract import protocol as p
from engine.contract.prefix_forest import PrefixForest
from engine.contract.state import PoolState


@dataclass
class ForestBuilder:
    state: PoolState                 # the reducer, following the same events
    forest: PrefixForest = field(default_factory=PrefixForest)
    texts: dict[str, list[str]] = field(default_factory=dict)  # seq_id -> text of each token, when known

    @classmethod
    def from_state(cls, state: PoolState) -> ForestBuilder:
        """Start from a state whose history is unknown: its cached blocks become roots (their
        parents were stored before this client saw the stream)."""
        b = cls(state.clone())
        for block in np.flatnonzero(b.state.has_hash).tolist():
            b.forest.store(b.state.hash_of(block), None, block=block, holders=int(b.state.ref_counts[block]),
                           at=state.last_event)
        return b

    @property
    def last_event(self) -> int:
        return self.state.last_event

    def apply(self, ev: p.AnyEvent) -> None:
        st, forest = self.state, self.forest
        if isinstance(ev, p.SwapOut):  # released tail first, as the allocator does
            st.apply(ev)
            for d, _ in reversed(ev.mapping):
                self._hold(d)
            return
        st.apply(ev)
        match ev:
            case p.RequestAdded():
                self.texts[ev.seq_id] = list(getattr(ev, "prompt_token_texts", None) or ())
            case p.Fork():
                self.texts[ev.seq_id] = list(self.texts.get(ev.parent_seq_id, ()))
                for b in ev.block_ids:
                    self._hold(b)
            case p.Append() if ev.token_ids:
                self.texts.setdefault(ev.seq_id, []).extend([ev.text] + [""] * (len(ev.token_ids) - 1))
            case p.Cached():
                forest.store(ev.hash, ev.parent_hash, self._label(ev), block=ev.block_id,
                             holders=int(st.ref_counts[ev.block_id]), at=ev.seq)
            case p.PrefixHit():
                forest.hit(ev.hash)
                self._hold(ev.block_id)
            case p.Free():
                self._hold(ev.block_id)
            case p.Cow():
                self._hold(ev.src_block_id)
            case p.Evict():
                forest.remove(ev.hash)
            case p.Finish():
                self.texts.pop(ev.seq_id, None)
            case p.Reset():
                forest.clear()
                self.texts.clear()

    def _hold(self, block: int) -> None:
        h = self.state.hash_of(block)
        if h is not None:
            self.forest.hold(h, int(self.state.ref_counts[block]))

    def _label(self, ev: p.Cached) -> str:
        """The text of the block's tokens: from the sequence that filled it (the event names it,
        else any holder), its prompt token texts and sampled texts."""
        seq_id = getattr(ev, "seq_id", None)
        seqs = self.state.seqs
        holder = seqs.get(seq_id) if seq_id else next(
            (s for s in seqs.values() if ev.block_id in s.block_table), None)
        if holder is None or ev.block_id not in holder.block_table:
            return ""
        texts, bs = self.texts.get(holder.seq_id, []), self.state.config.block_size
        i = holder.block_table.index(ev.block_id)
        return "".join(texts[i * bs:(i + 1) * bs])
