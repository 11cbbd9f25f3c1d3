"""The device block pool: how many block tables hold each block, and which block goes next.

Never-hashed free blocks sit in a FIFO, cached blocks that no table holds in an eviction policy
(engine/core/eviction.py): by default an LRU (an OrderedDict, least recently freed first, O(1)
each), as vLLM v1's BlockPool keeps its free queue. A block found again in the prefix cache
leaves the policy, and a block the policy gives up leaves the prefix cache (`evict`) before its
new owner gets it.
"""
from __future__ import annotations

from collections import deque

from engine.core.eviction import LRU, EvictionPolicy, Future
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
      first, FIFO) or `evictable` (in the prefix cache: the policy's order); a held block is in
      neither.
    """

    def __init__(self, num_blocks: int, cache: PrefixCache):
        self.cache = cache
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: EvictionPolicy = LRU()
        self._hit = None  # the policy's `hit`, where it counts hits (LRU does not: no call)

    def use(self, policy: EvictionPolicy, future: Future | None = None) -> None:
        """Evict by `policy` from now on; only before any block is cached (a fresh pool)."""
        if len(self.evictable) or any(h is not None for h in self.cache.hashes):
            raise RuntimeError("an eviction policy is chosen before any block is cached")
        if callable(bind := getattr(policy, "bind", None)):
            bind(self.cache, future)
        self.evictable = policy
        hit = getattr(policy, "hit", None)
        self._hit = None if hit is None or getattr(type(policy), "hit", None) is EvictionPolicy.hit else hit

    @property
    def num_allocatable(self) -> int:
        """Blocks a new owner can take: free ones and cached ones it would evict."""
        return len(self.free_ids) + len(self.evictable)

    def take(self) -> int:
        """A block for a new owner, ref count 1: a free one first, else the least recently
        used cached one (evicted first). Raises NoFreeBlocks."""
        if self.free_ids:
            b = self.free_ids.popleft()
        elif len(self.evictable):
            b = self.evictable.pop()
            self.cache.drop(b)
        else:
            raise NoFreeBlocks("the device pool has no free or evictable block")
        self.ref_counts[b] = 1
        return b

    def hold(self, b: int) -> None:
        """One more holder of b (a prefix hit, or a swap-in finding its content); a cached block
        that no one held leaves the eviction policy."""
        if not self.ref_counts[b]:
            self.evictable.remove(b)
        self.ref_counts[b] += 1
        if self._hit is not None:
            self._hit(b)

    def release(self, b: int) -> bool:
        """One holder of b less; at none it goes to the free FIFO, or, cached, to the LRU's most
        recently used end (the policy's: still hit-able until evicted). Returns whether none holds it now."""
        self.ref_counts[b] -= 1
        if self.ref_counts[b]:
            return False
        if self.cache.hashes[b] is None:
            self.free_ids.append(b)
        else:
            self.evictable.push(b)
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
