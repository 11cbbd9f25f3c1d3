"""The kinds of KV-cache group, a class each behind one interface, as vLLM v1 keeps a
SingleTypeKVCacheManager per group (FullAttentionManager, SlidingWindowManager).

A group's kind decides how many tokens its table covers at admission, the most blocks it holds at
once, which blocks a sequence no longer reads, and how long a prefix hit it can serve. The
BlockManager keeps the tables and the pools and asks each group's manager these questions; it
never tests a group's kind itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from kvscope_contract import protocol as p

NULL = p.NULL_BLOCK

# (logical block i, groups) -> the block of each group caching block i of the sequence, or None
# unless every one of them does
Lookup = Callable[[int, list[int]], "list[int] | None"]


class GroupManager(ABC):
    """One KV-cache group of a pool of blocks of `block_size` tokens."""

    LOOKUP_FIRST = False  # looked up before the other kinds when a prefix hit is sought

    def __init__(self, group: p.KVGroup, block_size: int):
        self.group, self.block_size = group, block_size

    @property
    def spec(self) -> tuple:
        """Groups of one spec cache alike: a prefix hit looks them up together."""
        return type(self), self.group.window

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens in one table (the last one possibly partial)."""
        return -(-num_tokens // self.block_size)

    def check(self, index: int) -> None:
        """Raise CommandError, naming the numbers, if this group (group `index` of its pool)
        cannot work with its block size."""

    @abstractmethod
    def admitted_tokens(self, num_tokens: int, hit_tokens: int, budget: int | None) -> int:
        """Tokens this group's table covers once a sequence of `num_tokens` is admitted with a
        prefix hit of `hit_tokens`, its first step computing `budget` tokens (None: all)."""

    @abstractmethod
    def peak_blocks(self, total_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a sequence growing to `total_tokens`, prefilled `chunk_tokens` at a
        time, holds at once in this group."""

    @abstractmethod
    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """The leading blocks of a table that the next token, with `num_computed_tokens` before
        it, no longer reads (at most: the table may be shorter)."""

    @abstractmethod
    def find_hit(self, lookup: Lookup, length: int, groups: list[int], tables: list[list[int]]) -> int:
        """Where the longest prefix hit of at most `length` blocks ends for `groups` (this spec's,
        this one among them), filling their `tables` with its blocks (NULL_BLOCK for a block the
        kind need not read). Called again with a shorter `length` when another kind could not
        serve as much."""


class FullAttentionManager(GroupManager):
    """Attention to every earlier token: blocks for the whole sequence, none ever skipped."""

    LOOKUP_FIRST = True  # any prefix of a hit is one: found once, it bounds the other kinds cheaply

    def admitted_tokens(self, num_tokens: int, hit_tokens: int, budget: int | None) -> int:
        return num_tokens

    def peak_blocks(self, total_tokens: int, chunk_tokens: int) -> int:
        return self.blocks_for(total_tokens)

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        return 0

    def find_hit(self, lookup: Lookup, length: int, groups: list[int], tables: list[list[int]]) -> int:
        """Every block from the first, up to the first one some group lacks; called again, the
        blocks found before, cut to the shorter `length`."""
        n = len(tables[groups[0]])
        while n < length and (found := lookup(n, groups)) is not None:
            for g, b in zip(groups, found):
                tables[g].append(b)
            n += 1
        for g in groups:
            del tables[g][length:]
        return min(n, length)


class SlidingWindowManager(GroupManager):
    """Attention to the last `sliding_window` tokens, the query's own included: blocks only for
    the tokens each step computes (a long prompt's prefill chunk by chunk, as vLLM allocates), and
    the blocks the window has passed given back (`window_free`; NULL_BLOCK in the table)."""

    def __init__(self, group: p.KVGroup, block_size: int):
        super().__init__(group, block_size)
        self.window = group.sliding_window

    def check(self, index: int) -> None:
        """A window smaller than a block cannot work: its blocks would leave it before they fill."""
        if (self.window or 0) < self.block_size:
            raise p.CommandError("invalid_argument", (
                f"KV-cache group {index} attends to a sliding window of {self.window} tokens, smaller "
                f"than a block of {self.block_size}: use a block size of at most {self.window}"))

    def admitted_tokens(self, num_tokens: int, hit_tokens: int, budget: int | None) -> int:
        return num_tokens if budget is None else min(num_tokens, hit_tokens + budget)

    def peak_blocks(self, total_tokens: int, chunk_tokens: int) -> int:
        """The window's blocks and a chunk's, and a block each side."""
        return min(self.blocks_for(total_tokens), self.blocks_for(self.window + chunk_tokens) + 1)

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def find_hit(self, lookup: Lookup, length: int, groups: list[int], tables: list[list[int]]) -> int:
        """Only the blocks the window reads before the hit's end: ceil((W - 1) / block_size) of
        them in a row, the rightmost such run within `length` (or fewer from block 0); NULL_BLOCK
        before the run."""
        need = -(-(self.window - 1) // self.block_size)
        if not need:  # a window of one token reads no earlier K/V: every block may be skipped
            for g in groups:
                tables[g][:] = [NULL] * length
            return length
        run, found_at = 0, {}
        for i in range(length - 1, -1, -1):  # right to left: the first run long enough wins
            found = lookup(i, groups)
            if found is None:
                run, found_at = 0, {}
                continue
            run += 1
            found_at[i] = found
            if run >= need:
                break
        end = (min(found_at) + run) if run >= need else run  # else: a shorter run from block 0
        if run < need:
            found_at = {i: f for i, f in found_at.items() if i < end}
        for k, g in enumerate(groups):
            tables[g][:] = [found_at[i][k] if i in found_at else NULL for i in range(end)]
        return end


MANAGERS: dict[p.KVGroupKind, type[GroupManager]] = {
    "full_attention": FullAttentionManager, "sliding_window": SlidingWindowManager}


def group_managers(config: p.PoolConfig) -> list[GroupManager]:
    """A manager per KV-cache group of `config`, in group order."""
    return [MANAGERS[g.kind](g, config.block_size) for g in config.groups]
