"""The host tier: full blocks kept in host memory, found by a prefix lookup that misses on the device.

vLLM v1's native CPU offloading (the OffloadingConnector over a CPUOffloadingManager with its LRU
policy), run synchronously inside the step: every full block a step computes is stored to the tier
(chunk level: a block the tier already holds, or one a prefix hit or a load brought, is not stored
again); a prefix lookup continues past the device's hit into the tier, and each block found there is
loaded into a new device block instead of being recomputed; the tier evicts its least recently used
block when a store needs room, on its own, whatever the device pool does. Keys are (KV-cache group,
chained block hash), as vLLM's OffloadKey packs them; a lookup or a store of a key makes it the most
recently used.

Where it differs from vLLM (docs/offload.md): stores and loads are copied inside the step that
decides them (loads before the forward, stores after it: no asynchronous transfer, so no
HIT_PENDING beyond the step), and a block stored in a step is loadable from the next step on.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Sequence as Seq

from kvscope_contract import protocol as p
from engine.core.block_pool import BlockPool
from engine.core.events import EventLog
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence
from kvscope_contract.snapshot_codec import hash_hex

Key = tuple[int, int]  # (KV-cache group, chained block hash)


class HostTier:
    """A host pool of `num_blocks` blocks with an LRU of its own, and the step's copies to make.

    Promises, after every public method returns:
    - Every block is in exactly one of `free` or `lru` (ready: loadable) or `pending` (stored
      this step; its copy is made after the forward, so not loadable, and not evictable, before
      `end_step`). `content[t]` is its (key, tokens) unless it is free.
    - `store` emits `offload_evict` (for the room it makes) then `offload_store`; `load` emits
      `offload_load`; once per change, in order.
    """

    def __init__(self, num_blocks: int, log: EventLog):
        self.num_blocks, self.log = num_blocks, log
        self.free: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[Key, int] = OrderedDict()  # ready blocks, least recently used first
        self.pending: dict[Key, int] = {}
        self.content: list[tuple[Key, tuple[int, ...]] | None] = [None] * num_blocks
        self.stores: list[tuple[int, int]] = []  # (device, host tier) to copy after this step's forward
        self.loads: list[tuple[int, int]] = []   # (host tier, device) to copy before it

    def __len__(self) -> int:
        """Blocks holding content (ready or pending)."""
        return self.num_blocks - len(self.free)

    def find(self, group: int, h: int, tokens: Seq[int]) -> int | None:
        """The ready block holding `tokens` under (group, h), or None (a miss, or stored this step)."""
        t = self.lru.get((group, h))
        return t if t is not None and self.content[t][1] == tuple(tokens) else None

    def touch(self, group: int, h: int) -> None:
        """The key was looked up (found on the device or here): it becomes the most recently used."""
        if (group, h) in self.lru:
            self.lru.move_to_end((group, h))

    def holds(self, group: int, h: int) -> bool:
        return (group, h) in self.lru or (group, h) in self.pending

    def store(self, block: int, group: int, h: int, tokens: Seq[int]) -> int | None:
        """Store device block `block` (cached under (group, h), its K/V computed by this step) unless
        the tier holds the key already (then it is touched); evicts the least recently used ready
        block when no block is free. Returns the tier's block, or None when nothing is stored (held
        already, or every block is pending: vLLM's prepare_store skips the store so)."""
        key = (group, h)
        if self.holds(group, h):
            self.touch(group, h)
            return None
        if not self.free:
            if not self.lru:
                return None
            (g, old), t = self.lru.popitem(last=False)
            self.content[t] = None
            self.log.emit(p.OffloadEvict(offload_block_id=t, hash=hash_hex(old), kv_group=g))
        else:
            t = self.free.popleft()
        self.pending[key], self.content[t] = t, (key, tuple(tokens))
        self.stores.append((block, t))
        self.log.emit(p.OffloadStore(block_id=block, offload_block_id=t, hash=hash_hex(h), kv_group=group))
        return t

    def load(self, t: int, block: int, seq_id: str, index: int) -> None:
        """Copy tier block t into new device block `block`, entry `index` of `seq_id`'s table (group
        and hash: t's); t stays in the tier, now the most recently used."""
        (group, h), _ = self.content[t]
        self.lru.move_to_end((group, h))
        self.loads.append((t, block))
        self.log.emit(p.OffloadLoad(seq_id=seq_id, offload_block_id=t, block_id=block, logical_index=index,
                                    hash=hash_hex(h), kv_group=group))

    def load_prefix(self, seq: Sequence, start: int, block_size: int, block_hash: Callable[[Sequence, int], int],
                    pool: BlockPool, cache: PrefixCache) -> int:
        """After a device hit of `start` full blocks of `seq` (group 0's table; each touched here),
        the blocks that follow it here, each loaded into a new device block of `pool` and cached
        there (`block_hash`: the chained hash of a full block). As on the device, never the block
        of the last token. Returns how many were loaded."""
        table = seq.block_tables[0]
        for i in range(start):
            self.touch(0, seq.block_hashes[i])
        for i in range(start, (len(seq) - 1) // block_size):
            h, tokens = block_hash(seq, i), seq.block_tokens(i, block_size)
            if (t := self.find(0, h, tokens)) is None:
                break
            table.append(b := pool.take())
            self.load(t, b, seq.seq_id, i)
            cache.register(b, 0, h, tokens, seq.block_hashes[i - 1] if i else None, seq.seq_id)
        return len(table) - start

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (loads, stores) to copy, handed to its batch; the stores become loadable at
        `end_step`."""
        out, self.loads, self.stores = (self.loads, self.stores), [], []
        return out

    def end_step(self) -> None:
        """The step's copies are made: what it stored is ready (most recently used, in store order)."""
        self.lru.update(self.pending)
        self.pending.clear()

    def keys(self) -> list[tuple[int, int, int]]:
        """(tier block, group, hash) of every block holding content, for a capture."""
        return [(t, c[0][0], c[0][1]) for t, c in enumerate(self.content) if c is not None]
