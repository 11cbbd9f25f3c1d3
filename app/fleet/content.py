"""Content identity for the prefix cache across a fleet: a cached block is named by the chain of
token ids from the start of its prompt, not by the hash its server gave it.

A server's block hash is only comparable within that server: vLLM's depends on its hash
algorithm and seed (with `--prefix-caching-hash-algo xxhash`, or sha256 without
`PYTHONHASHSEED`, each process draws its own root), on a request's `cache_salt` and on its LoRA;
KVScope's engine hashes with Python's tuple hash. The content id here is the same everywhere:
`content_id(parent's content id, this block's token ids)`, a 64-bit BLAKE2b, with the empty
string as the parent of a prompt's first block. Where a block's tokens were not seen (cached
before this dashboard attached, or a server that does not send them) the block is named by its
server hash (`HASH_PREFIX` + hash), and `ContentTracker.unknown` counts those blocks.

`ContentTracker` follows one KVScope-protocol stream (KVScope's engine or the vLLM plugin):
each sequence's token ids (its prompt's from `request_added`, then every `append`'s sampled
ids), and the content id of every cached block. Pure: no I/O, no clock.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.content import ROOT, cached_holder, chain_ids, content_id  # noqa: F401 (the fleet imports them from here)
from kvscope_contract.state import PoolState

HASH_PREFIX = "h:"   # an id made of the server's hash: this block's tokens are unknown here
EVICTED_KEPT = 65_536  # evicted contents remembered (the prompt box's "evicted"), newest kept


@dataclass(frozen=True)
class Content:
    """One cached block's content as one engine holds it."""
    cid: str                 # content id (or HASH_PREFIX + server hash)
    parent: str | None       # the parent's content id; ROOT for a prompt's first block; None unknown
    tokens: tuple[int, ...]  # its token ids, () when unknown
    server_hash: str         # the hash its server gave it
    kv_group: int = 0        # the KV-cache group whose layers' K/V it holds (a hybrid model stores a
    #                          prompt once per group)


@dataclass
class ContentTracker:
    block_size: int = 16
    seq_tokens: dict[str, list[int] | None] = field(default_factory=dict)  # None: the prompt's ids unknown
    by_block: dict[int, Content] = field(default_factory=dict)             # every hashed device block
    unknown: int = 0  # blocks in by_block named by their server hash
    # content id -> when (the caller's clock) a block holding it was evicted, newest last
    evicted: OrderedDict = field(default_factory=OrderedDict)

    @classmethod
    def from_state(cls, state: PoolState) -> ContentTracker:
        """A stream joined late: the blocks already hashed have unknown tokens."""
        t = cls(state.config.block_size)
        for b in np.flatnonzero(state.has_hash).tolist():
            t._put(b, None, state.hash_of(b), int(state.kv_group[b]))
        for s in state.seqs.values():
            t.seq_tokens[s.seq_id] = None
        return t

    def keep(self, old: ContentTracker) -> None:
        """After a resync: what `old` knew of the sequences and blocks that are still there (a
        block by the same hash) stays known."""
        for sid, toks in old.seq_tokens.items():
            if sid in self.seq_tokens and toks is not None:
                self.seq_tokens[sid] = toks
        for b, c in old.by_block.items():
            now = self.by_block.get(b)
            if now is not None and now.server_hash == c.server_hash and now.cid != c.cid:
                self._drop(b)
                self.by_block[b] = c
                self.unknown += c.cid.startswith(HASH_PREFIX)

    def apply(self, ev: p.AnyEvent, state: PoolState, now: float = 0.0) -> None:
        """Follow `ev`; `state` is the pool right after it, `now` the time an eviction is
        remembered at."""
        match ev:
            case p.RequestAdded():
                ids = ev.prompt_token_ids
                self.seq_tokens[ev.seq_id] = list(ids) if ids is not None and len(ids) == ev.prompt_tokens else None
            case p.Fork():
                parent = self.seq_tokens.get(ev.parent_seq_id)
                self.seq_tokens[ev.seq_id] = None if parent is None else list(parent)
            case p.Append(token_ids=ids) if ids:
                if (toks := self.seq_tokens.get(ev.seq_id)) is not None:
                    toks.extend(ids)
            case p.Cached():
                self._cached(ev, state)
            case p.Evict():
                if (c := self.by_block.get(ev.block_id)) is not None and not c.cid.startswith(HASH_PREFIX):
                    self.evicted[c.cid] = now
                    self.evicted.move_to_end(c.cid)
                    while len(self.evicted) > EVICTED_KEPT:
                        self.evicted.popitem(last=False)
                self._drop(ev.block_id)
            case p.Finish():
                self.seq_tokens.pop(ev.seq_id, None)
            case p.Reset():
                self.block_size = ev.config.block_size
                self.seq_tokens.clear()
                self.by_block.clear()
                self.evicted.clear()
                self.unknown = 0

    def _cached(self, ev: p.Cached, state: PoolState) -> None:
        seq_id, index = cached_holder(ev, state)
        toks = self.seq_tokens.get(seq_id) if seq_id is not None else None
        bs = self.block_size
        if toks is None or index is None or len(toks) < (index + 1) * bs:
            return self._put(ev.block_id, None, ev.hash, ev.kv_group)
        ids = chain_ids(toks[:(index + 1) * bs], bs)
        parent = ids[-2] if index else ROOT
        self._drop(ev.block_id)
        self.by_block[ev.block_id] = Content(ids[-1], parent, tuple(toks[index * bs:(index + 1) * bs]), ev.hash,
                                             ev.kv_group)

    def _put(self, b: int, parent: str | None, server_hash: str | None, kv_group: int = 0) -> None:
        self._drop(b)
        if server_hash is None:
            return
        self.by_block[b] = Content(HASH_PREFIX + server_hash, parent, (), server_hash, kv_group)
        self.unknown += 1

    def _drop(self, b: int) -> None:
        old = self.by_block.pop(b, None)
        if old is not None and old.cid.startswith(HASH_PREFIX):
            self.unknown -= 1

    def contents(self) -> Iterable[Content]:
        return self.by_block.values()
