"""The prefix cache across a fleet, by content (app/data/fleet/content.py): which engines hold each
cached block, the blocks and bytes the fleet holds more than once, the merged prefix forest, and
how a prefix-aware router would score a prompt on each engine.

Built from each engine's cached blocks at one moment (`FleetIndex.build`); plain data, no I/O.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvscope_contract.prefix_forest import PrefixForest
from app.data.fleet.content import HASH_PREFIX, ROOT, Content, chain_ids


@dataclass(frozen=True)
class EngineCache:
    """What one engine caches, as the index needs it."""
    name: str
    block_size: int
    bytes_per_block: int
    blocks: Sequence[Content]  # one per physical block (two copies of the same content: two entries)


@dataclass(frozen=True)
class Score:
    engine: str
    cached_tokens: int   # the longest cached prefix, full blocks only, as a prefix-aware router scores it
    reusable_tokens: int  # what the engine itself reuses: it always computes the prompt's last token
    blocks: int


@dataclass
class FleetIndex:
    # content id -> engine -> physical copies
    holders: dict[str, dict[str, int]] = field(default_factory=dict)
    parent: dict[str, str | None] = field(default_factory=dict)
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    server_hashes: dict[str, set[str]] = field(default_factory=dict)  # content id -> the hashes servers gave it
    engines: dict[str, EngineCache] = field(default_factory=dict)

    @classmethod
    def build(cls, caches: Sequence[EngineCache]) -> FleetIndex:
        ix = cls(engines={c.name: c for c in caches})
        for c in caches:
            for b in c.blocks:
                ix.holders.setdefault(b.cid, {}).setdefault(c.name, 0)
                ix.holders[b.cid][c.name] += 1
                if b.parent is not None or b.cid not in ix.parent:
                    ix.parent[b.cid] = b.parent
                if b.tokens:
                    ix.tokens[b.cid] = b.tokens
                ix.server_hashes.setdefault(b.cid, set()).add(b.server_hash)
        return ix

    # ------------------------------------------------------------------ duplication
    def copies(self, cid: str) -> int:
        return sum(self.holders[cid].values())

    def duplicated_blocks(self) -> int:
        """Physical blocks that hold content some other block of the fleet holds too: every
        copy but one of each content."""
        return sum(self.copies(cid) - 1 for cid in self.holders)

    def duplicated_bytes(self) -> int:
        """The bytes of those blocks, each at its own engine's bytes per block (from its hello;
        0 for a KV-event stream, which does not say); the copy not counted is the first, in
        engine order."""
        total = 0
        for held in self.holders.values():
            sizes = [self.engines[e].bytes_per_block for e, n in held.items() for _ in range(n)]
            total += sum(sizes) - (sizes[0] if sizes else 0)
        return total

    def shared_by(self) -> dict[int, int]:
        """How many contents are held by 1, 2, ... engines."""
        out: dict[int, int] = defaultdict(int)
        for held in self.holders.values():
            out[len(held)] += 1
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------ identity
    def unknown_blocks(self) -> int:
        """Cached blocks named by server hash (their tokens were not seen here)."""
        return sum(self.copies(cid) for cid in self.holders if cid.startswith(HASH_PREFIX))

    def hash_disagreements(self) -> int:
        """Contents held under different server hashes (by one engine or several): the servers'
        hashes cannot be compared, and a router that goes by hash sees different blocks."""
        return sum(1 for cid, hs in self.server_hashes.items() if len(hs) > 1 and not cid.startswith(HASH_PREFIX))

    def identity(self) -> str:
        """Which identity the index uses, and why, in a sentence."""
        unknown = self.unknown_blocks()
        total = sum(self.copies(c) for c in self.holders)
        text = ("Cached blocks are matched by content: the chain of token ids from the start of the prompt, "
                "not the servers' block hashes (those depend on each server's hash algorithm and seed, "
                "cache_salt and LoRA).")
        if unknown:
            text += (f" {unknown:,} of {total:,} blocks were cached before this dashboard saw their tokens: "
                     "they are matched by server hash, which only agrees between servers with the same "
                     "hash algorithm and seed.")
        if n := self.hash_disagreements():
            text += (f" Warning: {n:,} cached contents carry different hashes on different servers, so a "
                     "router matching hashes would not see them as the same prefix (set the same "
                     "PYTHONHASHSEED and --prefix-caching-hash-algo on every server).")
        return text

    # ------------------------------------------------------------------ the merged forest
    def forest(self) -> PrefixForest:
        """Every cached content once, under its parent's content id; a node's `copies` is the
        physical blocks fleet-wide (which engines hold it: `holders`). Its `holders` (the sequences
        holding it, in a single engine's forest) stays unknown: the index does not follow them."""
        f = PrefixForest()
        order = self._parents_first()
        for i, cid in enumerate(order):
            parent = self.parent.get(cid)
            node = f.store(cid, parent if parent not in (None, ROOT) else None, at=i, tokens=self.tokens.get(cid, ()))
            node.copies = self.copies(cid)
        return f

    def _parents_first(self) -> list[str]:
        depth: dict[str, int] = {}

        def d(cid: str) -> int:
            seen = []
            while cid not in depth:
                seen.append(cid)
                p = self.parent.get(cid)
                if p in (None, ROOT) or p not in self.holders or p in seen:
                    depth[cid] = 0
                    break
                cid = p
            base = depth[cid]
            for i, c in enumerate(reversed(seen)):
                depth.setdefault(c, base + i)
            return depth[seen[0]] if seen else base

        return sorted(self.holders, key=lambda c: (d(c), c))

    # ------------------------------------------------------------------ routing
    def score(self, tokens: Sequence[int]) -> list[Score]:
        """Per engine, the prompt's longest cached prefix in tokens (full blocks, each engine at
        its own block size), highest first."""
        by_engine: dict[str, set[str]] = defaultdict(set)
        for cid, held in self.holders.items():
            for e in held:
                by_engine[e].add(cid)
        out = []
        for name, eng in self.engines.items():
            bs = eng.block_size or 1
            have = by_engine.get(name, set())
            n = _prefix_blocks(chain_ids(tokens, bs), have)
            reusable = _prefix_blocks(chain_ids(tokens[:max(0, len(tokens) - 1)], bs), have)
            out.append(Score(name, n * bs, reusable * bs, n))
        return sorted(out, key=lambda s: -s.cached_tokens)

    def route(self, tokens: Sequence[int], free_blocks: Mapping[str, int] | None = None) -> str | None:
        """The engine a prefix-aware router picks for `tokens` (see `pick`)."""
        return pick(self.score(tokens), free_blocks)


def pick(scores: Sequence[Score], free_blocks: Mapping[str, int] | None = None) -> str | None:
    """The engine a prefix-aware router picks: the most cached tokens; a tie goes to the engine
    with the most free blocks, then by name."""
    free = free_blocks or {}
    best = min(scores, key=lambda s: (-s.cached_tokens, -free.get(s.engine, 0), s.engine), default=None)
    return best.engine if best else None


def _prefix_blocks(chain: list[str], have: set[str]) -> int:
    n = 0
    for cid in chain:
        if cid not in have:
            break
        n += 1
    return n
