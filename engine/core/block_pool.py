"""The device block pool: how many block tables hold each block, and which block goes next.

Each operation is O(1): never-hashed free blocks sit in a FIFO, cached blocks that no table
holds in an LRU (an OrderedDict, least recently freed first), as vLLM v1's BlockPool keeps its
free queue: a block found again in the prefix cache leaves the LRU, and a block taken from the
LRU leaves the prefix cache (`evict`) before its new owner gets it.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from engine.core.prefix_cache import PrefixCache


class NoFreeBlocks(RuntimeError):
    """An allocation found neither a free nor an evictable device block (or a swap-out too few
    host blocks); the scheduler's `can_*` checks exist so that it never sees this."""


class BlockPool:
    """Ref counts of the device blocks and the two queues of unheld ones.

    Only its methods change a ref count: `take` (a new owner), `hold` (one more, out of the LRU if
    no one held it), `share` and `unshare` (holders come or go while others stay), `release` (one
    less, into a queue at none).

    Promises, after every public method returns:
    - `ref_counts[b]` is the number of block-table entries (of live sequences, every KV-cache
      group) that name device block b.
    - A block with ref count 0 is in exactly one of `free_ids` (not in the prefix cache: reused
      first, FIFO) or `evictable` (in the prefix cache: LRU first); a held block is in neither.
    """

    def __init__(self, num_blocks: int, cache: PrefixCache):
        self.cache = cache
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_allocatable(self) -> int:
        """Blocks a new owner can take: free ones and cached ones it would evict."""
        return len(self.free_ids) + len(self.evictable)

    def take(self) -> int:
        """A block for a new owner, ref count 1: a free one first, else the least recently
        used cached one (evicted first). Raises NoFreeBlocks."""
        if self.free_ids:
            b = self.free_ids.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self.cache.drop(b)
        else:
            raise NoFreeBlocks("the device pool has no free or evictable block")
        self.ref_counts[b] = 1
        return b

    def hold(self, b: int) -> None:
        """One more holder of b; a cached block that no one held leaves the LRU."""
        if not self.ref_counts[b]:
            del self.evictable[b]
        self.ref_counts[b] += 1

    def release(self, b: int) -> bool:
        """One holder of b less; at none it goes to the free FIFO, or, cached, to the LRU's most
        recently used end (still hit-able until evicted). Returns whether none holds it now."""
        self.ref_counts[b] -= 1
        if self.ref_counts[b]:
            return False
        if self.cache.hashes[b] is None:
            self.free_ids.append(b)
        else:
            self.evictable[b] = None
        return True

    def share(self, b: int, n: int = 1) -> None:
        """`n` more holders of b, which someone holds already (a fork's child, sequences swapped in
        together): it is in no queue, so no queue changes."""
        assert self.ref_counts[b] > 0, f"block {b} has no holder to share it with"
        self.ref_counts[b] += n

    def unshare(self, b: int, n: int = 1) -> None:
        """`n` holders of b less, while others still hold it (the source of a copy-on-write, a block
        that several sequences swapped out together held): it stays in no queue."""
        assert self.ref_counts[b] > n, f"block {b} has {self.ref_counts[b]} holders, not more than {n}"
        self.ref_counts[b] -= n

    def clear_cache(self) -> int:
        """Evict every cached block that no table holds; returns how many."""
        evicted = list(self.evictable)
        for b in evicted:
            self.cache.drop(b)
            self.free_ids.append(b)
        self.evictable.clear()
        return len(evicted)
