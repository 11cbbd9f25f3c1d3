"""Eviction policies: which cached block with no holder the device pool reuses first.

The BlockPool (engine/core/block_pool.py) keeps the blocks that are cached (still hit-able) but
held by no block table in an `EvictionPolicy`, and asks it for a victim when it has no free
block left. Three come with KVScope, by name:

- `lru` (the default, the engine's own): vLLM v1's free-queue order. A block joins at the most
  recently used end when its last holder frees it and leaves when a prefix hit revives it; the
  victim is the least recently freed. A sequence frees its table tail first, so a chain's tail
  goes before its head.
- `lfu`: the block whose content was hit the fewest times since it was cached; ties by LRU.
- `opt`: Belady's clairvoyant policy, the bound any policy could reach: the block whose content
  is next looked up farthest in the future (or never). It needs the future: a `Future` that only
  a trace replay (engine/lab/trace_replay.py) can give.

A policy of your own is a subclass of `EvictionPolicy` (or any class with its methods) named by
its import path, `mypkg.mymod:MyPolicy` (docs/traces.md has an example):

    class MostRecentlyFreed(EvictionPolicy):
        def __init__(self): self.stack = {}
        def push(self, block): self.stack[block] = None
        def remove(self, block): del self.stack[block]
        def pop(self): return self.stack.popitem()[0]
        def __len__(self): return len(self.stack)
        def __iter__(self): return iter(reversed(self.stack))
"""
from __future__ import annotations

import heapq
import importlib
import itertools
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

if TYPE_CHECKING:
    from engine.core.prefix_cache import PrefixCache

NEVER = math.inf  # the next use of content no later request looks up


class Future(Protocol):
    """What OPT needs to know: when a block's content is looked up next."""

    def next_use(self, cache: PrefixCache, block: int) -> tuple[float, int]:
        """(when, rank) of the next lookup of cached `block`'s content, NEVER for none; among
        equal `when`s the higher rank is evicted first (a deeper block of a chain)."""

    def now(self) -> float:
        """The current time: a next use earlier than it has passed, and is asked again."""


class EvictionPolicy(ABC):
    """The cached blocks no table holds, and which of them is evicted first.

    The pool calls `push` when a block's last holder frees it (still cached), `remove` when a
    prefix hit (or a swap-in finding its content) revives it, `hit` at every hit on a cached
    block (held or not), and `pop` for the victim when no free block is left. Iterating yields
    the blocks in eviction order (first victim first) as far as the policy knows it; the
    dashboard's "next evicted" marks the first. Every method but `bind` and `hit` is required.
    """

    def bind(self, cache: PrefixCache, future: Future | None) -> None:
        """The pool's prefix cache (each block's hash and content) and, in a trace replay, the
        future; called once, before any other method."""

    @abstractmethod
    def push(self, block: int) -> None:
        """`block` became evictable: cached, no holder."""

    @abstractmethod
    def remove(self, block: int) -> None:
        """`block` is held again (it was evictable)."""

    @abstractmethod
    def pop(self) -> int:
        """The victim, which leaves the policy (the pool evicts it from the prefix cache)."""

    def hit(self, block: int) -> None:
        """`block`'s content was found by a prefix lookup."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[int]: ...

    def __contains__(self, block: int) -> bool:
        return any(b == block for b in self)

    def clear(self) -> None:
        """Forget every block (the prefix cache was cleared)."""
        while len(self):
            self.pop()


class LRU(EvictionPolicy):
    """vLLM v1's free queue: least recently freed first (an OrderedDict, O(1) each)."""
    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()

    def push(self, block: int) -> None:
        self.order[block] = None

    def remove(self, block: int) -> None:
        del self.order[block]

    def pop(self) -> int:
        return self.order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __contains__(self, block: int) -> bool:
        return block in self.order

    def clear(self) -> None:
        self.order.clear()


class _Heap(EvictionPolicy):
    """Evictable blocks in a heap of (key, order pushed, block), lazily deleted: an entry counts
    only while its block is evictable with that push."""

    def __init__(self) -> None:
        self.heap: list[tuple] = []
        self.live: dict[int, int] = {}  # evictable block -> the tick of its push
        self.ticks = itertools.count()

    @abstractmethod
    def key(self, block: int): ...

    def push(self, block: int) -> None:
        tick = next(self.ticks)
        self.live[block] = tick
        heapq.heappush(self.heap, (self.key(block), tick, block))

    def remove(self, block: int) -> None:
        del self.live[block]

    def _top(self) -> int:
        heap, live = self.heap, self.live
        while live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2]

    def pop(self) -> int:
        b = self._top()
        heapq.heappop(self.heap)
        del self.live[b]
        return b

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self) -> Iterator[int]:
        live = self.live
        return (b for _, t, b in sorted(self.heap) if live.get(b) == t)

    def __contains__(self, block: int) -> bool:
        return block in self.live

    def clear(self) -> None:
        self.heap.clear()
        self.live.clear()


class LFU(_Heap):
    """Fewest hits since the content was cached first; ties least recently freed first. A block's
    count is fixed while it is evictable (a hit would revive it), so its heap key is too."""
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.hits: dict[int, int] = {}  # cached block -> prefix hits on its content

    def key(self, block: int) -> int:
        return self.hits.get(block, 0)

    def hit(self, block: int) -> None:
        self.hits[block] = self.hits.get(block, 0) + 1

    def pop(self) -> int:
        b = super().pop()
        self.hits.pop(b, None)  # evicted: the next content of this block starts afresh
        return b

    def clear(self) -> None:
        super().clear()
        self.hits.clear()


class OPT(_Heap):
    """Belady's MIN: the block whose content is next looked up farthest in the future (never
    first), a deeper block of a chain before its parent on a tie, then least recently freed.

    A key is the next use after the time it was computed; once the clock passes it (that lookup
    came and did not revive the block: its chain had broken earlier) it is stale. Stale entries
    are found through a second heap ordered by key and asked again, each at most once per use of
    its content, so a victim is always the true farthest."""
    name = "opt"

    def __init__(self) -> None:
        super().__init__()
        self.expiry: list[tuple[float, int, int]] = []  # (when, tick, block): the same entries by when
        self.cache: PrefixCache | None = None
        self.future: Future | None = None

    def bind(self, cache: PrefixCache, future: Future | None) -> None:
        if future is None:
            raise ValueError("the opt policy needs the future requests: it runs only on a trace replay")
        self.cache, self.future = cache, future

    def key(self, block: int) -> tuple[float, int]:
        when, rank = self.future.next_use(self.cache, block)
        return -when, -rank  # a min-heap: farthest first, deepest first

    def push(self, block: int) -> None:
        tick = next(self.ticks)
        self.live[block] = tick
        key = self.key(block)
        heapq.heappush(self.heap, (key, tick, block))
        if key[0] != -NEVER:
            heapq.heappush(self.expiry, (-key[0], tick, block))

    def _refresh(self) -> None:
        now, expiry, live = self.future.now(), self.expiry, self.live
        while expiry and expiry[0][0] < now:
            _, tick, b = heapq.heappop(expiry)
            if live.get(b) == tick:  # still evictable under that key: ask again
                del live[b]
                self.push(b)

    def pop(self) -> int:
        self._refresh()
        return super().pop()

    def __iter__(self) -> Iterator[int]:
        self._refresh()
        return super().__iter__()

    def clear(self) -> None:
        super().clear()
        self.expiry.clear()


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU, "opt": OPT}


def load_policy(spec: str) -> Callable[[], EvictionPolicy]:
    """A policy class by name (lru, lfu, opt) or by import path (`package.module:Class`).

    Raises:
        ValueError: naming the spec, when it is neither.
    """
    if spec in POLICIES:
        return POLICIES[spec]
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"eviction policy {spec!r}: say one of {', '.join(POLICIES)} or module.path:Class")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"eviction policy {spec!r}: {e}") from None
    missing = [m for m in ("push", "remove", "pop", "__len__", "__iter__") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"eviction policy {spec!r} lacks {', '.join(missing)} (see engine/core/eviction.py)")
    return cls


def policy_name(spec: str) -> str:
    """How a spec is shown: a built-in's name, or a class path's last part."""
    return spec if spec in POLICIES else spec.rpartition(":")[2]
