"""Each sequence's block tables over one device pool, a prefix cache, a host pool for swap and a
host tier for offloading.

A model's layers form KV-cache groups (kvscope_contract/kv_groups.py): one for a full-attention
model, several for a hybrid one (Gemma 3: five sliding-window groups and one full-attention
group). Every group has its own block table per sequence, drawn from the one BlockPool. The
BlockManager is the coordinator, as vLLM v1's KVCacheCoordinator: what differs between kinds of
group is asked of each group's manager (engine/core/group_managers.py: how much a table covers at
admission, which blocks a window has passed, how long a prefix hit each kind serves), the ref
counts and the LRU are the BlockPool's (engine/core/block_pool.py), swapping is the Swapper's
(engine/core/swap.py), the host tier the HostTier's (engine/core/offload.py). A prefix hit is the
longest prefix that every group can serve. Every change of state emits its protocol events, in
order, through the event log.
"""
from __future__ import annotations

from functools import partial
from typing import Iterable

from kvscope_contract import protocol as p
from engine.core.block_pool import BlockPool, NoFreeBlocks
from engine.core.capture import PoolCapture
from engine.core.events import EventLog
from engine.core.group_managers import GroupManager, group_managers
from engine.core.host_pool import HostPool
from engine.core.offload import HostTier
from engine.core.prefix_cache import PrefixCache, chain_hash
from engine.core.sequence import Sequence
from engine.core.swap import Swapper
from kvscope_contract.snapshot_codec import hash_hex
from kvscope_contract.state import PoolState

__all__ = ["BlockManager", "NoFreeBlocks", "WATERMARK"]

NULL = p.NULL_BLOCK
WATERMARK = 0.01  # share of device blocks admission leaves free, so running sequences can grow


class BlockManager:
    """Owns every KV block: which table of which sequence holds which device block, the prefix
    cache, and the host pool sequences are swapped to.

    Promises, after every public method returns (besides the BlockPool's, PrefixCache's and
    HostPool's own):
    - Every sequence has one device table and one host table per group; a table entry is a
      block of that group or NULL_BLOCK (a sliding window has passed it, or a prefix hit
      skipped it); the tables of all groups cover the same logical blocks.
    - Admission and swap-in leave at least `watermark_blocks` allocatable, so running sequences
      can keep growing one token at a time; appends and copy-on-write may use the watermark.
    - Each change is emitted as its protocol event, in the order it happened, so the reducer
      (kvscope_contract/state.py) replays the pools exactly.
    """

    def __init__(self, config: p.PoolConfig, log: EventLog, watermark: float = WATERMARK):
        self.log = log
        self.watermark = watermark
        self._build(config)

    def check(self, config: p.PoolConfig) -> None:
        """Raise CommandError, naming the numbers, for a pool whose groups cannot work: a window
        smaller than a block (its blocks would leave the window before they are full), or fewer
        blocks than one per group."""
        groups = config.groups
        for i, manager in enumerate(group_managers(config)):
            manager.check(i)
        watermark = int(self.watermark * config.num_device_blocks)
        usable = config.num_device_blocks - len(config.reserved_blocks) - watermark
        if usable < len(groups):
            raise p.CommandError("invalid_argument", (
                f"{config.num_device_blocks} device blocks ({usable} above the watermark) cannot give a "
                f"request one block in each of the model's {len(groups)} KV-cache groups: use at least "
                f"{len(groups) + len(config.reserved_blocks) + watermark + 1} blocks"))
        if config.num_offload_blocks and (len(groups) > 1 or not config.enable_prefix_caching):
            raise p.CommandError("invalid_argument", "the host tier finds blocks by their prefix hash: it needs "
                                 "prefix caching on and a pool of one KV-cache group (no hybrid model yet)")

    def _build(self, config: p.PoolConfig) -> None:
        self.check(config)
        n = config.num_device_blocks
        self.config, self.block_size, self.groups = config, config.block_size, config.groups
        self.managers = group_managers(config)
        specs: dict[tuple, list[int]] = {}  # the groups of each spec, looked up together for a hit
        for g, manager in enumerate(self.managers):
            specs.setdefault(manager.spec, []).append(g)
        self.kinds: list[tuple[GroupManager, list[int]]] = sorted(
            ((self.managers[gs[0]], gs) for gs in specs.values()), key=lambda kind: not kind[0].LOOKUP_FIRST)
        self.cache = PrefixCache(n, len(self.groups), self.log)
        self.pool = BlockPool(n, self.cache)
        self.host = HostPool(config.num_host_blocks)
        self.offload = HostTier(config.num_offload_blocks, self.log) if config.num_offload_blocks else None
        self.swap = Swapper(self.pool, self.cache, self.host, self.log, self._release, self.new_tables)
        self.watermark_blocks = int(self.watermark * n)

    def reset(self, config: p.PoolConfig) -> None:
        """Drop every block and sequence mapping and rebuild the pools with `config` (whose
        groups, if it names none, stay the model's)."""
        if not config.kv_groups and self.config.kv_groups:
            config = p.PoolConfig(**{**_fields(config), "kv_groups": self.config.kv_groups})
        self._build(config)
        self.log.emit(p.Reset(config=config))

    def new_tables(self) -> list[list[int]]:
        """Empty tables, one per group, for a new sequence."""
        return [[] for _ in self.groups]

    # ------------------------------------------------------------------ queries
    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones it would evict (the wire's
        `free_blocks` counts only the first)."""
        return self.pool.num_allocatable

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds and the prefix cache does not keep."""
        return len(self.pool.free_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with no holder still in the prefix cache (evictable, still hit-able)."""
        return len(self.pool.evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens in one table (the last one possibly partial)."""
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, total_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a sequence growing to `total_tokens`, prefilled `chunk_tokens` at a
        time, holds at once, alone in the pool: each group's `peak_blocks`."""
        return sum(m.peak_blocks(total_tokens, chunk_tokens) for m in self.managers)

    def can_ever_fit(self, total_tokens: int, chunk_tokens: int) -> bool:
        """Whether such a sequence fits an otherwise empty pool above the watermark (False: it can
        never be admitted, whatever finishes)."""
        return self.peak_blocks(total_tokens, chunk_tokens) <= self.max_blocks_per_seq

    @property
    def max_blocks_per_seq(self) -> int:
        return self.config.num_device_blocks - len(self.config.reserved_blocks) - self.watermark_blocks

    def can_allocate(self, seq: Sequence, budget: int | None = None) -> bool:
        """Whether `allocate(seq, budget)` would leave at least `watermark_blocks` allocatable:
        its prefix hits cost nothing unless they leave the LRU (a cached block with no holder).

        Args:
            seq: a waiting sequence holding no block.
            budget: tokens its first step may compute (None: every token).
        Returns:
            True when it can be admitted now.
        """
        hits = self._prefix_hits(seq)
        held = [b for blocks in hits for b in blocks if b != NULL]
        revived = sum(1 for b in held if not self.pool.ref_counts[b])
        hit = len(hits[0]) * self.block_size
        need = sum(max(0, m.blocks_for(m.admitted_tokens(len(seq), hit, budget)) - len(blocks))
                   for m, blocks in zip(self.managers, hits)) + revived
        return self.num_allocatable_blocks - need >= self.watermark_blocks

    def blocks_to_append(self, seq: Sequence, num_tokens: int = 1) -> int:
        """Blocks computing the next `num_tokens` of `seq` takes: per group, the new ones those
        tokens reach into, or a copy of a shared block the first of them is written to.

        Args:
            seq: a running sequence.
            num_tokens: tokens the step computes (1 when decoding).
        Returns:
            The blocks `append_slot(seq, num_tokens)` takes from the pool.
        """
        upto, refs = seq.num_computed_tokens + num_tokens, self.pool.ref_counts
        last, need = (upto - 1) // self.block_size, self.num_blocks_for(upto)
        return sum(need - len(t) if need > len(t) else refs[t[last]] > 1 for t in seq.block_tables)

    def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
        """Whether `append_slot(seq, num_tokens)` can succeed (it may dip into the watermark).

        Args:
            seq: a running sequence whose next `num_tokens` have no slot yet.
            num_tokens: tokens the step computes (1 when decoding).
        Returns:
            True when the pool can give every group the blocks it needs.
        """
        return self.num_allocatable_blocks >= self.blocks_to_append(seq, num_tokens)

    def can_swap_out(self, group: list[Sequence]) -> bool:
        """Whether the host pool can take `group`'s blocks (`Swapper.can_swap_out`).

        Args:
            group: running sequences swapped together (a fork group, or one sequence).
        Returns:
            True when `swap.swap_out(group)` would not raise.
        """
        return self.swap.can_swap_out(group)

    def can_swap_in(self, group: list[Sequence]) -> bool:
        """Whether bringing `group` back (a block they share once, one still held on the device
        not at all) leaves at least `watermark_blocks` allocatable.

        Args:
            group: swapped sequences coming back together.
        Returns:
            True when they can be swapped in now.
        """
        return self.num_allocatable_blocks - self.swap.blocks_to_swap_in(group) >= self.watermark_blocks

    # ------------------------------------------------------------------ prefix cache
    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of full block i of `seq` (memoised on the sequence)."""
        hs, bs = seq.block_hashes, self.block_size
        while len(hs) <= i:
            j = len(hs)
            hs.append(chain_hash(hs[-1] if hs else None, seq.block_tokens(j, bs)))
        return hs[i]

    def _cached(self, seq: Sequence, i: int, groups: list[int]) -> list[int] | None:
        """The blocks of `groups` caching full block i of `seq`, or None unless every one does."""
        h, tokens = self._block_hash(seq, i), seq.block_tokens(i, self.block_size)
        found = [self.cache.find(g, h, tokens) for g in groups]
        return None if None in found else found

    def _prefix_hits(self, seq: Sequence) -> list[list[int]]:
        """Per group, the cached blocks `seq` would start with (NULL_BLOCK where a kind need not
        read a block): the longest prefix of full blocks, never its last token, that every group
        can serve. Each kind of group shortens the candidate in turn (`GroupManager.find_hit`)
        until a whole round leaves it as it is, as vLLM v1's coordinator finds a hybrid hit."""
        tables: list[list[int]] = self.new_tables()
        if not self.config.enable_prefix_caching:
            return tables
        lookup, length = partial(self._cached, seq), (len(seq) - 1) // self.block_size  # in blocks
        k = last = 0  # the kind to ask next, and the last one that shortened the candidate
        while True:
            manager, groups = self.kinds[k]
            if (found := manager.find_hit(lookup, length, groups, tables)) < length:
                length, last = found, k
            k = (k + 1) % len(self.kinds)
            if k == last:
                return tables

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the full blocks among the first `num_tokens` of `seq` to the prefix cache, in
        every group.

        Called when a step is scheduled to compute those tokens: the forward stores every
        token's K/V before any attention reads the cache, so a hit in the same step is sound.

        Args:
            seq: a sequence holding blocks for at least `num_tokens` tokens.
            num_tokens: its tokens whose K/V the step computes or has computed.
        """
        if not self.config.enable_prefix_caching:
            return
        bs, full = self.block_size, num_tokens // self.block_size
        for i in range(seq.num_registered_blocks, full):
            h = self._block_hash(seq, i)
            parent = seq.block_hashes[i - 1] if i else None
            tokens = seq.block_tokens(i, bs)
            for g, table in enumerate(seq.block_tables):
                if table[i] != NULL:
                    fresh = self.cache.register(table[i], g, h, tokens, parent, seq.seq_id)
                    if fresh and self.offload is not None:  # computed by this step: stored after its forward
                        self.offload.store(table[i], g, h, tokens)
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def clear_prefix_cache(self) -> int:
        """Evict every cached block that no sequence holds (an `evict` each).

        Returns:
            How many blocks were evicted.
        """
        return self.pool.clear_cache()

    # ------------------------------------------------------------------ block moves
    def _alloc(self, seq: Sequence, group: int, index: int) -> int:
        b = self.pool.take()
        self.log.emit(p.Alloc(seq_id=seq.seq_id, block_id=b, logical_index=index, kv_group=group))
        return b

    def _release(self, b: int) -> None:
        if self.pool.release(b):
            self.host.unpair_device(b)

    # ------------------------------------------------------------------ sequence operations
    def allocate(self, seq: Sequence, budget: int | None = None) -> int:
        """Blocks for a waiting `seq` in every group, cached prefix first: a full-attention
        group's for every token, a sliding-window group's for the tokens its first step computes.

        Each hit's ref count goes up by one (a hit on a block with no holder takes it out of
        the LRU); the other blocks are new, ref count 1. The caller checks `can_allocate` first
        (the watermark).

        Args:
            seq: a waiting sequence holding no block.
            budget: tokens its first step may compute (None: every token).
        Returns:
            The tokens of the prefix hit (a multiple of the block size): their K/V is cached.
        """
        assert not any(seq.block_tables), f"{seq.seq_id} already holds blocks"
        hits = self._prefix_hits(seq)
        seq.block_tables = self.new_tables()
        for g, blocks in enumerate(hits):  # every hit is taken before any eviction could reuse it
            for i, b in enumerate(blocks):
                seq.block_tables[g].append(b)
                if b != NULL:
                    self.pool.hold(b)
                    self.log.emit(p.PrefixHit(seq_id=seq.seq_id, block_id=b, logical_index=i, kv_group=g,
                                              hash=hash_hex(self.cache.hashes[b])))
        hit = len(hits[0])
        if self.offload is not None:  # the rest of the prefix, as far as the host tier holds it
            hit += self.offload.load_prefix(seq, hit, self.block_size, self._block_hash, self.pool, self.cache)
        for g, table in enumerate(seq.block_tables):
            m = self.managers[g]
            for i in range(hit, m.blocks_for(m.admitted_tokens(len(seq), hit * self.block_size, budget))):
                table.append(self._alloc(seq, g, i))
        seq.num_registered_blocks = hit
        return hit * self.block_size

    def free_window(self, seq: Sequence) -> None:
        """Free each group's blocks that the next token of `seq` no longer reads (`skipped_blocks`:
        a sliding window's, the tokens before `num_computed_tokens - W + 1` in whole blocks; none
        of full attention's), cached ones staying hit-able. Their entries become NULL_BLOCK;
        freed from the window's edge back, as vLLM does, stopping at the first entry freed before.

        Args:
            seq: a running (or just admitted) sequence, before its next step is scheduled.
        """
        for g, manager in enumerate(self.managers):
            table = seq.block_tables[g]
            for i in range(min(manager.skipped_blocks(seq.num_computed_tokens), len(table)) - 1, -1, -1):
                b = table[i]
                if b == NULL:
                    break
                table[i] = NULL
                self._release(b)
                self.log.emit(p.WindowFree(seq_id=seq.seq_id, kv_group=g, logical_index=i, block_id=b,
                                           ref_count=self.pool.ref_counts[b]))

    def append_slot(self, seq: Sequence, num_tokens: int = 1) -> list[tuple[int, int]]:
        """Room, in every group, for the K/V of the next `num_tokens` of `seq` (decoding: its
        last token): new blocks up to the last of them, or a copy of a shared block they write
        into. May use the watermark; raises NoFreeBlocks when no block is left (the caller
        checks `can_append`).

        Args:
            seq: a running sequence.
            num_tokens: tokens the step computes (1 when decoding).
        Returns:
            The (src, dst) copies the model runner must make first: `src` loses this holder,
            `dst` (ref count 1) takes its place in `seq`'s table of that group.
        """
        upto, copies = seq.num_computed_tokens + num_tokens, []
        i, need = (upto - 1) // self.block_size, self.num_blocks_for(upto)
        for g, table in enumerate(seq.block_tables):
            if need > len(table):
                while need > len(table):
                    table.append(self._alloc(seq, g, len(table)))
                continue
            src = table[i]
            if self.pool.ref_counts[src] == 1:
                self.host.unpair_device(src)  # written in place: a host copy of it would be stale
                continue
            dst = self.pool.take()
            self.pool.unshare(src)  # still held by another
            table[i] = dst
            self.log.emit(p.Cow(seq_id=seq.seq_id, logical_index=i, src_block_id=src, dst_block_id=dst,
                                kv_group=g))
            copies.append((src, dst))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (whose K/V is computed) in every group: each
        block's ref count goes up by one, nothing is copied until a write (`append_slot`'s
        copy-on-write).

        Args:
            parent: a running sequence that sampled its first token.
            child: a new sequence with the parent's tokens and no blocks.
        """
        child.block_tables = [list(t) for t in parent.block_tables]
        for table in child.block_tables:
            for b in table:
                if b != NULL:
                    self.pool.share(b)  # held by the parent
        full = parent.num_computed_tokens // self.block_size  # blocks both sequences agree on
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        tables = [list(t) for t in child.block_tables] if len(self.groups) > 1 else []
        self.log.emit(p.Fork(request_id=child.request_id, parent_seq_id=parent.seq_id, seq_id=child.seq_id,
                             block_ids=list(child.block_table), block_tables=tables))

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, group by group, each table's tail first, so chain tails
        are evicted first: each ref count goes down by one (a `free` event carries the count
        left); its host blocks, if swapped, go back to the host pool.

        Args:
            seq: a sequence that finishes, is aborted or is preempted by recompute.
        """
        for g, table in enumerate(seq.block_tables):
            while table:
                b = table.pop()
                if b == NULL:
                    continue
                self._release(b)
                self.log.emit(p.Free(seq_id=seq.seq_id, block_id=b, ref_count=self.pool.ref_counts[b], kv_group=g))
        self.swap.drop_host_tables(seq)
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ observation
    def capture(self, seqs: Iterable[Sequence]) -> PoolCapture:
        """A copy of the pools, given every live sequence (in creation order): cheap enough to
        take between steps even for a million blocks; `state()` does the rest anywhere.

        Args:
            seqs: every live sequence, in creation order.
        Returns:
            A PoolCapture whose `state()` is the reducer's PoolState at the log's last event.
        """
        return PoolCapture.of(self.config, self.log.seq, self.pool.ref_counts, self.cache, seqs,
                              self.offload.keys() if self.offload is not None else ())

    def state(self, seqs: Iterable[Sequence]) -> PoolState:
        """The pools as the reducer sees them, given every live sequence (in creation order)."""
        return self.capture(seqs).state()


def _fields(config: p.PoolConfig) -> dict:
    return {f: getattr(config, f) for f in config.__struct_fields__}
