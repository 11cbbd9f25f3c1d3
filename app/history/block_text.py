"""What a block's tokens say, for the grid's hover: the first few dozen characters of every
block, from the per-token prompt texts of `request_added` and the text of each `append` (the
dashboard has no tokenizer), and by hash for cached blocks, which outlive their holders.

One store per history, shared by every copy of the mirror and only ever written by the live
stream (an event numbered at or below the last one it saw changes nothing), so time travel
reads it as it is: a token's text never changes once known. Its memory is bounded: one short
string per block held by a live sequence, per cached block, and per block of the most
recently finished sequences.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState

PREVIEW = 40          # characters kept per block
KEEP_FINISHED = 1024  # finished sequences whose texts stay, newest last


@dataclass
class SeqText:
    blocks: list[str] = field(default_factory=list)  # per logical block, at most PREVIEW chars
    tokens: int = 0                                  # tokens whose text is known


@dataclass
class BlockTexts:
    block_size: int = 16
    last: int = 0
    seqs: dict[str, SeqText] = field(default_factory=dict)
    finished: OrderedDict = field(default_factory=OrderedDict)  # seq_id -> SeqText
    by_hash: dict[str, str] = field(default_factory=dict)       # text of each cached block

    def apply(self, ev: p.AnyEvent, state: PoolState) -> None:
        """Record what `ev` says about texts; `state` is the pool right after it."""
        if ev.seq <= self.last:
            return
        self.last = ev.seq
        match ev:
            case p.RequestAdded(prompt_token_texts=texts) if texts:
                bs = self.block_size
                self.seqs[ev.seq_id] = SeqText(
                    ["".join(texts[i:i + bs])[:PREVIEW] for i in range(0, len(texts), bs)], len(texts))
            case p.RequestAdded():
                self.seqs.pop(ev.seq_id, None)
            case p.Fork() if (parent := self.seqs.get(ev.parent_seq_id)):
                self.seqs[ev.seq_id] = SeqText(list(parent.blocks), parent.tokens)
            case p.Append(token_ids=ids) if ids and (s := self.seqs.get(ev.seq_id)):
                i = s.tokens // self.block_size  # the block of the first sampled token
                if i == len(s.blocks):
                    s.blocks.append("")
                if len(s.blocks[i]) < PREVIEW:
                    s.blocks[i] = (s.blocks[i] + ev.text)[:PREVIEW]
                s.tokens += len(ids)
            case p.Cached():
                if (text := self.of_holder(state, ev.block_id, ev.seq_id)) is not None:
                    self.by_hash[ev.hash] = text
            case p.Evict():
                self.by_hash.pop(ev.hash, None)
            case p.Finish() if (s := self.seqs.pop(ev.seq_id, None)):
                self.finished[ev.seq_id] = s
                while len(self.finished) > KEEP_FINISHED:
                    self.finished.popitem(last=False)
            case p.Reset():
                self.block_size = ev.config.block_size
                self.seqs.clear()
                self.by_hash.clear()

    def of_holder(self, state: PoolState, b: int, seq_id: str | None) -> str | None:
        """Device block b's text from the sequence that holds it (`seq_id`, else its only holder)."""
        if seq_id is None and state.ref_counts[b] == 1:
            seq_id = state.names.get(int(state.holder[b]))
        s = state.seqs.get(seq_id) if seq_id else None
        if s is None:
            return None
        table = s.block_tables[int(state.kv_group[b])] if len(s.block_tables) > 1 else s.block_table  # b's group's
        for i in range(len(table) - 1, -1, -1):  # blocks are registered near the end
            if table[i] == b:
                return self.text(s.seq_id, i)
        return None

    def text(self, seq_id: str, index: int) -> str | None:
        """The start of the text of logical block `index` of a sequence, if known."""
        s = self.seqs.get(seq_id) or self.finished.get(seq_id)
        return s.blocks[index] if s and index < len(s.blocks) else None

    def of_block(self, state: PoolState, b: int, holders: list[tuple[str, int]]) -> str | None:
        """Device block b's text: from a holder (seq_id, logical index), else by its hash."""
        for seq_id, index in holders:
            if (t := self.text(seq_id, index)) is not None:
                return t
        h = state.hash_of(b)
        return self.by_hash.get(h) if h else None
