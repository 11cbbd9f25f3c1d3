"""The prefix cache: full device blocks findable by the chained hash of their tokens.

A full block's hash chains its parent's (the block before it in the sequence) with its own
token ids, so one hash names a whole prefix. Each KV-cache group caches its own blocks (their
K/V are of different layers), so a lookup names the group: vLLM v1 keys its map by (hash,
group id) the same way.
"""
from __future__ import annotations

from typing import Sequence as Seq

from kvscope_contract import protocol as p
from engine.core.events import EventLog
from kvscope_contract.snapshot_codec import hash_hex

NO_PARENT = -1  # hash() never returns -1, so no real block hash can equal it


def chain_hash(parent: int | None, tokens: Seq[int]) -> int:
    """The hash of a full block whose parent block hashed to `parent` (None: the first block)."""
    return hash((NO_PARENT if parent is None else parent, *tokens))


class PrefixCache:
    """Which device blocks hold which full blocks of tokens, per KV-cache group.

    Promises, after every public method returns:
    - A hashed block is in `maps[group]` under its chained hash, its tokens kept to rule out a
      hash collision; `hashes[b]` is None for every other block.
    - `register` emits `cached` and `drop` emits `evict`, once per change, in order.
    Whether a block is held or free is the BlockPool's business, not this one's.
    """

    def __init__(self, num_blocks: int, num_groups: int, log: EventLog):
        self.log = log
        self.hashes: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.group_of: list[int] = [0] * num_blocks  # the group a hashed block is cached for
        self.maps: list[dict[int, int]] = [{} for _ in range(num_groups)]

    def find(self, group: int, h: int, tokens: Seq[int]) -> int | None:
        """The block of `group` caching hash `h` with exactly these tokens, or None."""
        b = self.maps[group].get(h)
        return b if b is not None and self.tokens[b] == tuple(tokens) else None

    def register(self, b: int, group: int, h: int, tokens: Seq[int], parent: int | None,
                 seq_id: str) -> bool:
        """Cache block b of `group` under `h`, unless it or that content is cached already;
        returns whether it was."""
        if self.hashes[b] is not None or h in self.maps[group]:
            return False
        self.hashes[b], self.tokens[b], self.group_of[b] = h, tuple(tokens), group
        self.maps[group][h] = b
        self.log.emit(p.Cached(block_id=b, hash=hash_hex(h), seq_id=seq_id, kv_group=group,
                               parent_hash=None if parent is None else hash_hex(parent)))
        return True

    def drop(self, b: int) -> None:
        """Block b leaves the cache (it is about to be reused, or the cache is cleared)."""
        h, group = self.hashes[b], self.group_of[b]
        del self.maps[group][h]
        self.hashes[b] = self.tokens[b] = None
        self.log.emit(p.Evict(block_id=b, hash=hash_hex(h), kv_group=group))

    def hashed(self) -> int:
        """How many blocks the cache holds."""
        return sum(map(len, self.maps))
