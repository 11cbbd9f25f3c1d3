"""The prefix cache as a forest: each cached block a node under its parent's hash.

The model knows nothing of where its blocks come from. KVScope's events feed it through
`app/derived/prefix_events.py`, a vLLM / SGLang / TensorRT-LLM KV-event stream (BlockStored /
BlockRemoved / AllBlocksCleared) through `integrations/kv_events/model.py`, with the same calls:
`store`, `remove`, `clear`, and, where the source knows them, `hold` (how many sequences hold a
block) and `hit`. A source that does not de-duplicate (vLLM) stores the same content once per
physical block: the node counts its copies and stays until the last one is removed.
On a hybrid pool each KV-cache group caches its own blocks under the same chained hashes: a
node is one hash with its block in each group (`blocks`), in use while any group's block is
held, and stays while any group caches it; the eviction order is of (hash, group) entries, as
the engine's free queue is of blocks. `app/panels/prefix_tree.py` draws it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

IN_USE, CACHED_ONLY, UNKNOWN = "in use", "cached only", "stored"


@dataclass
class Node:
    key: str                       # the block's hash, as the source spells it
    parent: str | None             # the parent block's hash; None for the first block of a prompt
    label: str = ""                # the text of its tokens, "" when unknown
    block: int | None = None       # its physical block, when the source says
    medium: str | None = None      # where it lives (vLLM: GPU, CPU_TIERED, ...), when the source says
    holders: int | None = None     # sequences holding it now (0: cached only); None when unknown
    hits: int = 0                  # times a request found it in the cache
    stored: float = 0              # when it was stored (event number, or the source's clock)
    copies: int = 1                # physical blocks caching this content (stored, not yet removed)
    tokens: Sequence[int] = ()     # its token ids, when the source says
    blocks: dict[int, int] = field(default_factory=dict)  # KV-cache group -> its block there (a hybrid pool)
    held: dict[int, int] = field(default_factory=dict)    # KV-cache group -> sequences holding its block

    @property
    def state(self) -> str:
        return UNKNOWN if self.holders is None else IN_USE if self.holders else CACHED_ONLY


class PrefixForest:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        # parent hash -> child hashes, whether or not the parent is cached (it may come back)
        self.children: dict[str, list[str]] = {}
        # cached-only (hash, KV-cache group) entries, least recently released first: the eviction
        # order (for sources that report holders)
        self.lru: OrderedDict[tuple[str, int], None] = OrderedDict()

    # ------------------------------------------------------------------ changes
    def store(self, key: str, parent: str | None, label: str = "", *, block: int | None = None,
              medium: str | None = None, holders: int | None = None, at: float = 0,
              tokens: Sequence[int] = (), group: int | None = None) -> Node:
        """A block enters the cache. Stored again while cached, it is one more copy of the same
        content: its fields are replaced, its hit count kept. `group`: the KV-cache group that
        caches it, on a hybrid pool (the same hash in another group is that group's block)."""
        old = self.nodes.get(key)
        if old is not None and group is not None and group not in old.blocks:  # another group's block
            old.blocks[group] = block
            old.copies += 1
            self.hold(key, holders, group)
            return old
        if old is not None and old.parent != parent:
            self._unlink(old)
        blocks = {} if group is None else {**(old.blocks if old else {}), group: block}
        node = self.nodes[key] = Node(key, parent, label, block, medium, None, old.hits if old else 0, at,
                                      old.copies + 1 if old else 1, tokens, blocks, dict(old.held) if old else {})
        if parent is not None and (old is None or old.parent != parent):
            self.children.setdefault(parent, []).append(key)
        self.hold(key, holders, group)
        return node

    def remove(self, key: str, group: int | None = None) -> bool:
        """One copy of a block leaves the cache (evicted; `group`: its KV-cache group's, on a
        hybrid pool); with its last copy the node goes, and its children stay, under a parent
        no longer cached. False if the block was not cached."""
        node = self.nodes.get(key)
        if node is None or group is not None and group not in node.blocks:
            return False
        node.copies -= 1
        if group is not None:
            del node.blocks[group]
            node.held.pop(group, None)
            self.lru.pop((key, group), None)
            if node.blocks:
                node.block = node.blocks[min(node.blocks)]
                node.holders = max(node.held.values(), default=0)
        if not node.copies:
            del self.nodes[key]
            self._unlink(node)
            for entry in [e for e in self.lru if e[0] == key]:
                del self.lru[entry]
        return True

    def clear(self) -> None:
        self.nodes.clear()
        self.children.clear()
        self.lru.clear()

    def hold(self, key: str, holders: int | None, group: int | None = None) -> None:
        """How many sequences hold the block (of KV-cache `group`) now: at 0 it becomes the most
        recently used of the cached-only blocks, the last to be evicted. A hybrid pool's node is
        in use while any group's block is held."""
        node = self.nodes.get(key)
        if node is None:
            return
        entry = (key, group or 0)
        if group is not None and holders is not None:
            node.held[group] = holders
            node.holders = max(node.held.values())
        else:
            node.holders = holders
        self.lru.pop(entry, None)
        if holders == 0:
            self.lru[entry] = None

    def hit(self, key: str) -> None:
        if (node := self.nodes.get(key)) is not None:
            node.hits += 1

    def _unlink(self, node: Node) -> None:
        siblings = self.children.get(node.parent) if node.parent is not None else None
        if siblings and node.key in siblings:
            siblings.remove(node.key)

    # ------------------------------------------------------------------ reading
    @property
    def victim(self) -> str | None:
        """The hash of the cached-only block evicted next when a block is needed and none is free."""
        return next(iter(self.lru), (None,))[0]

    @property
    def victim_group(self) -> int | None:
        """The KV-cache group of that block (0 on a one-group pool)."""
        return next(iter(self.lru), (None, None))[1]

    def roots(self) -> list[Node]:
        """Nodes whose parent is not cached (a prompt's first block, or a chain whose head was
        evicted), oldest first."""
        return sorted((n for n in self.nodes.values() if n.parent is None or n.parent not in self.nodes),
                      key=lambda n: n.stored)

    def kids(self, node: Node) -> list[Node]:
        """The cached children of `node`, oldest first."""
        return sorted((self.nodes[k] for k in self.children.get(node.key, ()) if k in self.nodes),
                      key=lambda n: n.stored)

    def chain(self, node: Node) -> list[Node]:
        """`node` and its descendants while each has exactly one child."""
        run = [node]
        while len(kids := self.kids(run[-1])) == 1:
            run.append(kids[0])
        return run

    def copies(self) -> int:
        """Physical blocks caching its nodes: the copies of the same content counted."""
        return sum(n.copies for n in self.nodes.values())

    def stats(self) -> dict[str, int]:
        states = [n.state for n in self.nodes.values()]
        return {"blocks": len(self.nodes), "copies": self.copies(), "roots": len(self.roots()),
                "groups": len({g for n in self.nodes.values() for g in n.blocks}),
                "in use": states.count(IN_USE), "cached only": states.count(CACHED_ONLY),
                "hits": sum(n.hits for n in self.nodes.values()),
                "leaves": sum(1 for n in self.nodes.values() if not self.kids(n))}
