"""Swap: moving sequences between the device pool and the host pool, a fork group at a time.

Sequences swapped together (a fork group, as vLLM v0 swapped a sequence group) move each block
once: a block they share is copied once and shared on the other side. Nothing is copied where the
other side already holds the same K/V: the pair a HostPool remembers (a sibling swapped earlier),
or, coming back, the block of the prefix cache that caches a host block's content.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from kvscope_contract import protocol as p
from engine.core.block_pool import BlockPool, NoFreeBlocks
from engine.core.events import EventLog
from engine.core.host_pool import HostPool
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence

NULL = p.NULL_BLOCK


class Swapper:
    """Swaps fork groups out to the host pool and back, emitting `swap_out` and `swap_in`.

    Promises, after every public method returns (besides the pools' own): a swapped-out sequence
    holds host tables and empty device tables, a swapped-in one the reverse, each table the same
    length as before, NULL_BLOCK where it was.
    """

    def __init__(self, pool: BlockPool, cache: PrefixCache, host: HostPool, log: EventLog,
                 release: Callable[[int], None], new_tables: Callable[[], list[list[int]]]):
        self.pool, self.cache, self.host, self.log = pool, cache, host, log
        self.release = release  # one holder of a device block less (the BlockManager's: it unpairs)
        self.new_tables = new_tables  # empty tables, one per KV-cache group

    def can_swap_out(self, group: list[Sequence]) -> bool:
        """Whether the host pool can take `group`'s blocks: a block they share counted once, one
        with a host copy already not at all."""
        need = sum(b not in self.host.host_copy for b in _distinct(group, "block_tables"))
        return len(self.host.free) >= need

    def blocks_to_swap_in(self, group: list[Sequence]) -> int:
        """Device blocks bringing `group` back takes from the allocatable ones: a block they share
        once, one still held on the device not at all (a cached one found again leaves the LRU)."""
        on_device = self._on_device(_distinct(group, "host_tables"))
        return sum(not (d is not None and self.pool.ref_counts[d]) for d in on_device.values())

    def _on_device(self, hosts: list[int]) -> dict[int, int | None]:
        """Per host block, a device block that holds the same K/V, or None: its pair (a sibling
        still holds it), else the prefix cache's block of the same content (a host block copied
        from a cached block). Each device block answers for one host block at most."""
        out, taken = {}, set()
        for h in hosts:
            d = self.host.device_copy.get(h)
            if d is None and (content := self.host.content.get(h)) is not None:
                d = self.cache.find(*content)
            out[h] = d if d is not None and d not in taken else None
            taken.add(out[h])
        return out

    def swap_out(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Move `group` (sequences swapped together: a fork group) to the host pool, each
        device block once: a block they share gets one host block, shared as it was, and a block
        whose host copy an earlier swap left (a sibling swapped before) joins that copy.

        Returns:
            The (device, host) pairs to copy.
        """
        if not self.can_swap_out(group):
            raise NoFreeBlocks(f"the host pool cannot hold the blocks of {', '.join(s.seq_id for s in group)}")
        distinct = _distinct(group, "block_tables")
        copied = {b: self.host.take() for b in distinct if b not in self.host.host_copy}
        for b, h in copied.items():
            if (hashed := self.cache.hashes[b]) is not None:
                self.host.content[h] = (self.cache.group_of[b], hashed, self.cache.tokens[b])
        to_host = {b: copied.get(b, self.host.host_copy.get(b)) for b in distinct}
        to_host[NULL] = NULL
        holders = Counter(b for seq in group for t in seq.block_tables for b in t)
        for b in reversed(distinct):  # tail first, so a chain's end is evicted first
            self.pool.unshare(b, holders[b] - 1)
            self.release(b)
            self.host.hold(to_host[b], holders[b])
        for seq in group:
            seq.host_tables = [[to_host[b] for b in t] for t in seq.block_tables]
            seq.block_tables = self.new_tables()
            seq.num_registered_blocks = 0
        for b, h in copied.items():
            if self.pool.ref_counts[b]:  # still held on the device: the next sibling to leave joins h
                self.host.pair(b, h)
        mapping = list(copied.items())
        self.log.emit(p.SwapOut(seq_id=group[0].seq_id, mapping=mapping, seq_ids=_ids(group),
                                shared=[(b, to_host[b]) for b in distinct if b not in copied]))
        return mapping

    def swap_in(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Bring `group` back to fresh device blocks, a host block they share to one device
        block they share, a host block whose device copy is still held to that block, and a host
        block whose content the prefix cache still holds to the cached block (nothing copied:
        the cached block leaves the LRU if no one held it).

        Returns:
            The (host, device) pairs to copy.
        """
        distinct = _distinct(group, "host_tables")
        found = {h: d for h, d in self._on_device(distinct).items() if d is not None}
        for d in found.values():
            self.pool.hold(d)  # before any take: a cached block leaves the LRU, never evicted here
        copied = {h: self.pool.take() for h in distinct if h not in found}
        to_device = {**copied, **found, NULL: NULL}
        holders = Counter(h for seq in group for t in seq.host_tables for h in t)
        for h in distinct:  # one holder each so far: the rest of the tables naming it
            self.pool.share(to_device[h], holders[h] - 1)
        for seq in group:
            seq.block_tables = [[to_device[h] for h in t] for t in seq.host_tables]
            self.drop_host_tables(seq)
        for h, d in copied.items():
            if self.host.ref_counts[h]:  # still held on the host: a sibling coming back later joins d
                self.host.pair(d, h)
        mapping = list(copied.items())
        self.log.emit(p.SwapIn(seq_id=group[0].seq_id, mapping=mapping, seq_ids=_ids(group),
                               shared=[(h, found[h]) for h in distinct if h in found]))
        return mapping

    def drop_host_tables(self, seq: Sequence) -> None:
        """`seq` lets go of its host blocks (swapped in, or gone while swapped out): each goes back
        to the host pool once no other sequence holds it."""
        for table in seq.host_tables:
            for h in table:
                if h != NULL:
                    self.host.release(h)
        seq.host_tables = self.new_tables()


def _ids(group: list[Sequence]) -> list[str]:
    """The wire's `seq_ids`: left empty for a sequence swapped alone."""
    return [s.seq_id for s in group] if len(group) > 1 else []


def _distinct(group: list[Sequence], tables: str) -> list[int]:
    """The blocks of the group's tables (`block_tables` or `host_tables`), each once, NULL
    entries left out: KV-cache group by group, then in the order the sequences' tables name them."""
    num_groups = len(getattr(group[0], tables))
    return list(dict.fromkeys(b for g in range(num_groups) for seq in group
                              for b in getattr(seq, tables)[g] if b != NULL))
