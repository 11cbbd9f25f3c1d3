"""The paged KV block pools: a device pool with a prefix cache, and a host pool for swap.

Every change of state emits its protocol events, in order, through the event log. Each
per-block operation is O(1): free blocks sit in a FIFO, cached blocks with no holder in an
LRU (an OrderedDict), and prefix lookups go through a dict keyed by chained block hashes.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from kvscope_contract import protocol as p
from engine.core.events import EventLog
from engine.core.sequence import Sequence
from kvscope_contract.state import MASK64, PoolState, SeqState, hash_hex

NO_PARENT = -1  # hash() never returns -1, so no real block hash can equal it
WATERMARK = 0.01  # share of device blocks admission leaves free, so running sequences can grow


class NoFreeBlocks(RuntimeError):
    """An allocation found neither a free nor an evictable device block (or a swap-out too few
    host blocks); the scheduler's `can_*` checks exist so that it never sees this."""


class BlockManager:
    """Owns every KV block: which sequence holds which device block, how many hold it, which
    blocks the prefix cache can hand out again, and the host pool sequences are swapped to.

    Promises, after every public method returns:
    - `ref_counts[b]` is the number of block tables (of live sequences) that list device block
      b; a block with ref count 0 is in exactly one of `free_ids` (never hashed, reused first,
      FIFO) or `evictable` (hashed, LRU first), and a block with a holder is in neither.
    - A hashed block is in `hash_to_block` under its chained hash, with its tokens kept to rule
      out collisions; evicting it (taking it for a new owner) emits `evict` first.
    - Admission and swap-in leave at least `watermark_blocks` allocatable, so running sequences
      can keep growing one token at a time; appends and copy-on-write may use the watermark.
    - Each change is emitted as its protocol event, in the order it happened, so the reducer
      (kvscope_contract/state.py) replays the pools exactly.
    """

    def __init__(self, config: p.PoolConfig, log: EventLog, watermark: float = WATERMARK):
        self.log = log
        self.watermark = watermark
        self._build(config)

    def _build(self, config: p.PoolConfig) -> None:
        n = config.num_device_blocks
        self.config = config
        self.block_size = config.block_size
        self.ref_counts = [0] * n
        self.hashes: list[int | None] = [None] * n
        self.tokens: list[tuple[int, ...] | None] = [None] * n  # rules out hash collisions
        self.hash_to_block: dict[int, int] = {}
        self.free_ids: deque[int] = deque(range(n))          # never hashed: reused first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, no holder, LRU first
        self.host_free: deque[int] = deque(range(config.num_host_blocks))
        self.host_ref_counts = [0] * config.num_host_blocks  # sequences holding each host block
        # a device block and a host block holding the same K/V while both are held (a swap copied
        # one to the other and some holders stayed behind): the next swap of a holder shares it
        self.host_copy: dict[int, int] = {}    # device -> host
        self.device_copy: dict[int, int] = {}  # host -> device
        self.watermark_blocks = int(self.watermark * n)

    def reset(self, config: p.PoolConfig) -> None:
        """Drop every block and sequence mapping and rebuild the pools with `config`."""
        self._build(config)
        self.log.emit(p.Reset(config=config))

    # ------------------------------------------------------------------ queries
    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones it would evict (the wire's
        `free_blocks` counts only the first)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with no holder still in the prefix cache (evictable, still hit-able)."""
        return len(self.evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (the last one possibly partial)."""
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits an otherwise empty pool above the watermark
        (False: it can never be admitted, whatever finishes)."""
        return self.num_blocks_for(num_tokens) <= self.config.num_device_blocks - self.watermark_blocks

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would leave at least `watermark_blocks` allocatable: its
        prefix hits cost nothing unless they leave the LRU (a cached block with no holder)."""
        hits = self._prefix_hits(seq)
        revived = sum(1 for b in hits if not self.ref_counts[b])  # hits that leave the LRU
        need = self.num_blocks_for(len(seq)) - len(hits) + revived
        return self.num_allocatable_blocks - need >= self.watermark_blocks

    def slot_needs_block(self, seq: Sequence) -> bool:
        """Whether writing the next token needs a block: a new one, or a copy of a shared one."""
        n, table = len(seq), seq.block_table
        return n > len(table) * self.block_size or self.ref_counts[table[(n - 1) // self.block_size]] > 1

    def can_append(self, seq: Sequence) -> bool:
        """Whether `append_slot(seq)` can succeed (it may dip into the watermark)."""
        return self.num_allocatable_blocks >= self.slot_needs_block(seq)

    def can_swap_out(self, group: list[Sequence]) -> bool:
        """Whether the host pool can take `group`'s blocks: a block they share counted once, one
        with a host copy already not at all."""
        need = sum(b not in self.host_copy for b in self._distinct_blocks(group, "block_table"))
        return len(self.host_free) >= need

    def can_swap_in(self, group: list[Sequence]) -> bool:
        """Whether bringing `group` back (a block they share once, one still on the device not at
        all) leaves at least `watermark_blocks` allocatable."""
        need = sum(h not in self.device_copy for h in self._distinct_blocks(group, "host_table"))
        return self.num_allocatable_blocks - need >= self.watermark_blocks

    # ------------------------------------------------------------------ prefix cache
    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of full block i of `seq` (memoised on the sequence)."""
        hs, bs = seq.block_hashes, self.block_size
        while len(hs) <= i:
            j = len(hs)
            hs.append(hash((hs[-1] if hs else NO_PARENT, *seq.token_ids[j * bs:(j + 1) * bs])))
        return hs[i]

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the leading full blocks of `seq`, never its last token."""
        if not self.config.enable_prefix_caching:
            return []
        bs, hits = self.block_size, []
        for i in range((len(seq) - 1) // bs):
            b = self.hash_to_block.get(self._block_hash(seq, i))
            if b is None or self.tokens[b] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(b)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the full blocks among the first `num_tokens` of `seq` to the prefix cache.

        Called when a step is scheduled to compute those tokens: the forward stores every
        token's K/V before any attention reads the cache, so a hit in the same step is sound.
        """
        if not self.config.enable_prefix_caching:
            return
        bs, full = self.block_size, num_tokens // self.block_size
        for i in range(seq.num_registered_blocks, full):
            b = seq.block_table[i]
            h = self._block_hash(seq, i)
            if self.hashes[b] is None and h not in self.hash_to_block:
                self.hashes[b], self.hash_to_block[h] = h, b
                self.tokens[b] = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                parent = hash_hex(seq.block_hashes[i - 1]) if i else None
                self.log.emit(p.Cached(block_id=b, hash=hash_hex(h), parent_hash=parent, seq_id=seq.seq_id))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def clear_prefix_cache(self) -> int:
        """Evict every cached block that no sequence holds; returns how many."""
        evicted = list(self.evictable)
        for b in evicted:
            self._drop_hash(b)
            self.free_ids.append(b)
        self.evictable.clear()
        return len(evicted)

    def _drop_hash(self, b: int) -> None:
        h = self.hashes[b]
        del self.hash_to_block[h]
        self.hashes[b] = self.tokens[b] = None
        self.log.emit(p.Evict(block_id=b, hash=hash_hex(h)))

    # ------------------------------------------------------------------ block moves
    def _take_free(self) -> int:
        """A block for a new owner, with ref count 1: a never-hashed free one first, else the
        least recently used cached one (evicted: its hash leaves the cache). Raises NoFreeBlocks."""
        if self.free_ids:
            b = self.free_ids.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._drop_hash(b)
        else:
            raise NoFreeBlocks("the device pool has no free or evictable block")
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int) -> None:
        """Drop one holder of `b`; at 0 it goes to the free FIFO, or, hashed, to the LRU's most
        recently used end (still hit-able until evicted)."""
        self.ref_counts[b] -= 1
        if not self.ref_counts[b]:
            self._unpair_device(b)
            if self.hashes[b] is None:
                self.free_ids.append(b)
            else:
                self.evictable[b] = None  # most recently used end

    def _alloc(self, seq: Sequence, index: int) -> int:
        b = self._take_free()
        self.log.emit(p.Alloc(seq_id=seq.seq_id, block_id=b, logical_index=index))
        return b

    # ------------------------------------------------------------------ sequence operations
    def allocate(self, seq: Sequence) -> int:
        """Blocks for every token of a waiting `seq`, cached prefix first.

        Each hit's ref count goes up by one (a hit on a block with no holder takes it out of
        the LRU); the other blocks are new, ref count 1. Returns how many leading tokens already
        have their K/V in the cache. The caller checks `can_allocate` first (the watermark).
        """
        assert not seq.block_table, f"{seq.seq_id} already holds blocks"
        hits = self._prefix_hits(seq)
        for i, b in enumerate(hits):  # take hits before any eviction could reuse them
            if not self.ref_counts[b]:
                del self.evictable[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
            self.log.emit(p.PrefixHit(seq_id=seq.seq_id, block_id=b, logical_index=i,
                                      hash=hash_hex(self.hashes[b])))
        for i in range(len(hits), self.num_blocks_for(len(seq))):
            seq.block_table.append(self._alloc(seq, i))
        seq.num_registered_blocks = len(hits)
        return len(hits) * self.block_size

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Room for the K/V of the last token of `seq`: a new block at a boundary, or a
        copy of a shared last block. Returns (src, dst) when the data must be copied: `src`
        loses this holder, `dst` (ref count 1) takes its place in `seq`'s table. May use the
        watermark; raises NoFreeBlocks when no block is left (the caller checks `can_append`)."""
        n, table = len(seq), seq.block_table
        if n > len(table) * self.block_size:
            table.append(self._alloc(seq, len(table)))
            return None
        i = (n - 1) // self.block_size
        src = table[i]
        if self.ref_counts[src] == 1:
            self._unpair_device(src)  # written in place: a host copy of it would be stale
            return None
        dst = self._take_free()
        self.ref_counts[src] -= 1
        table[i] = dst
        self.log.emit(p.Cow(seq_id=seq.seq_id, logical_index=i, src_block_id=src, dst_block_id=dst))
        return src, dst

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (whose K/V is computed): each block's ref
        count goes up by one, nothing is copied until a write (`append_slot`'s copy-on-write)."""
        child.block_table = list(parent.block_table)
        for b in child.block_table:
            self.ref_counts[b] += 1
        full = parent.num_computed_tokens // self.block_size  # blocks both sequences agree on
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        self.log.emit(p.Fork(request_id=child.request_id, parent_seq_id=parent.seq_id,
                             seq_id=child.seq_id, block_ids=list(child.block_table)))

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, the tail first, so chain tails are evicted first:
        each ref count goes down by one (a `free` event carries the count left); its host
        blocks, if swapped, go back to the host pool."""
        table = seq.block_table
        while table:
            b = table.pop()
            self._release(b)
            self.log.emit(p.Free(seq_id=seq.seq_id, block_id=b, ref_count=self.ref_counts[b]))
        for h in seq.host_table:
            self._release_host(h)
        seq.host_table = []
        seq.num_registered_blocks = 0

    def swap_out(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Move `group` (sequences swapped together: a fork group) to the host pool, each
        device block once: a block they share gets one host block, shared as it was, and a block
        whose host copy an earlier swap left (a sibling swapped before) joins that copy.
        Returns the (device, host) pairs to copy."""
        if not self.can_swap_out(group):
            raise NoFreeBlocks(f"the host pool cannot hold the blocks of {', '.join(s.seq_id for s in group)}")
        distinct = self._distinct_blocks(group, "block_table")
        copied = {b: self.host_free.popleft() for b in distinct if b not in self.host_copy}
        to_host = {b: copied.get(b, self.host_copy.get(b)) for b in distinct}
        holders = Counter(b for seq in group for b in seq.block_table)
        for b in reversed(distinct):  # tail first, so a chain's end is evicted first
            self.ref_counts[b] -= holders[b] - 1
            self._release(b)
            self.host_ref_counts[to_host[b]] += holders[b]
        for seq in group:
            seq.host_table = [to_host[b] for b in seq.block_table]
            seq.block_table = []
            seq.num_registered_blocks = 0
        for b, h in copied.items():
            if self.ref_counts[b]:  # still held on the device: the next sibling to leave joins h
                self._pair(b, h)
        mapping = list(copied.items())
        self.log.emit(p.SwapOut(seq_id=group[0].seq_id, mapping=mapping, seq_ids=_ids(group),
                                shared=[(b, h) for b, h in to_host.items() if b not in copied]))
        return mapping

    def swap_in(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Bring `group` back to fresh device blocks, a host block they share to one device
        block they share, and a host block whose device copy is still held to that block.
        Returns the (host, device) pairs to copy."""
        distinct = self._distinct_blocks(group, "host_table")
        copied = {h: self._take_free() for h in distinct if h not in self.device_copy}
        for d in copied.values():
            self.ref_counts[d] = 0
        to_device = {h: copied.get(h, self.device_copy.get(h)) for h in distinct}
        for seq in group:
            seq.block_table = [to_device[h] for h in seq.host_table]
            for h in seq.host_table:
                self.ref_counts[to_device[h]] += 1
                self._release_host(h)
            seq.host_table = []
        for h, d in copied.items():
            if self.host_ref_counts[h]:  # still held on the host: a sibling coming back later joins d
                self._pair(d, h)
        mapping = list(copied.items())
        self.log.emit(p.SwapIn(seq_id=group[0].seq_id, mapping=mapping, seq_ids=_ids(group),
                               shared=[(h, d) for h, d in to_device.items() if h not in copied]))
        return mapping

    def _pair(self, d: int, h: int) -> None:
        """Device block d and host block h hold the same K/V (for as long as both are held)."""
        self.host_copy[d], self.device_copy[h] = h, d

    def _unpair_device(self, d: int) -> None:
        if (h := self.host_copy.pop(d, None)) is not None:
            del self.device_copy[h]

    def _release_host(self, h: int) -> None:
        self.host_ref_counts[h] -= 1
        if not self.host_ref_counts[h]:
            self.host_free.append(h)
            if (d := self.device_copy.pop(h, None)) is not None:
                del self.host_copy[d]

    @staticmethod
    def _distinct_blocks(group: list[Sequence], table: str) -> list[int]:
        """The blocks of the group's tables, each once, in the order the tables first name it."""
        return list(dict.fromkeys(b for seq in group for b in getattr(seq, table)))

    # ------------------------------------------------------------------ observation
    def capture(self, seqs: Iterable[Sequence]) -> PoolCapture:
        """A copy of the pools, given every live sequence (in creation order): cheap enough to
        take between steps even for a million blocks; `state()` does the rest anywhere."""
        return PoolCapture(self.config, self.log.seq, self.ref_counts[:], self.hashes[:], [
            SeqState(s.seq_id, s.request_id, s.status.value, list(s.block_table), list(s.host_table),
                     s.num_computed_tokens, s.num_prompt_tokens, s.num_output_tokens,
                     s.params.max_tokens, s.text) for s in seqs])

    def state(self, seqs: Iterable[Sequence]) -> PoolState:
        """The pools as the reducer sees them, given every live sequence (in creation order)."""
        return self.capture(seqs).state()


def _ids(group: list[Sequence]) -> list[str]:
    """The wire's `seq_ids`: left empty for a sequence swapped alone."""
    return [s.seq_id for s in group] if len(group) > 1 else []


@dataclass
class PoolCapture:
    config: p.PoolConfig
    last_event: int
    ref_counts: list[int]
    hashes: list[int | None]
    seqs: list[SeqState]

    def state(self) -> PoolState:
        """The reducer's state: each hash's `hash_hex` digits as the number they spell."""
        has = np.fromiter((h is not None for h in self.hashes), bool, len(self.hashes))
        values = np.zeros(len(self.hashes), np.uint64)
        values[has] = np.fromiter((h & MASK64 for h in self.hashes if h is not None), np.uint64)
        return PoolState.build(self.config, self.last_event, self.ref_counts, (has, values, {}), self.seqs)
