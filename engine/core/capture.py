"""The pools copied between steps, and turned into the reducer's state anywhere else.

The engine thread copies (`BlockManager.capture`: a few list copies, cheap even for a million
blocks); `PoolCapture.state()` builds the reducer's PoolState from the copy on any thread, as the
server does to encode snapshots off the engine thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from kvscope_contract import protocol as p
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence
from kvscope_contract.snapshot_codec import MASK64, hash_hex
from kvscope_contract.state import PoolState, SeqState


@dataclass
class PoolCapture:
    config: p.PoolConfig
    last_event: int
    ref_counts: list[int]
    hashes: list[int | None]
    cached_groups: list[int] | None  # the group each hashed block is cached for (None: one group)
    seqs: list[SeqState]
    offload: list[tuple[int, int, int]]  # the host tier's (block, group, hash) holding content

    @classmethod
    def of(cls, config: p.PoolConfig, last_event: int, ref_counts: list[int], cache: PrefixCache,
           seqs: Iterable[Sequence], offload: list[tuple[int, int, int]] = ()) -> PoolCapture:
        """A copy of the pools: their ref counts, the prefix cache's hashes, every live sequence
        (in creation order), the host tier's keys."""
        return cls(config, last_event, ref_counts[:], cache.hashes[:],
                   cache.group_of[:] if len(config.groups) > 1 else None, [
            SeqState(s.seq_id, s.request_id, s.status.value, [list(t) for t in s.block_tables],
                     [list(t) for t in s.host_tables], s.num_computed_tokens, s.num_prompt_tokens,
                     s.num_output_tokens, s.params.max_tokens, s.text) for s in seqs], list(offload))

    def state(self) -> PoolState:
        """The reducer's state: each hash's `hash_hex` digits as the number they spell."""
        has = np.fromiter((h is not None for h in self.hashes), bool, len(self.hashes))
        values = np.zeros(len(self.hashes), np.uint64)
        values[has] = np.fromiter((h & MASK64 for h in self.hashes if h is not None), np.uint64)
        groups = None if self.cached_groups is None else np.where(has, self.cached_groups, 0)
        return PoolState.build(self.config, self.last_event, self.ref_counts, (has, values, {}), self.seqs, groups,
                               [(t, hash_hex(h), g) for t, g, h in self.offload])
