"""The prefix cache across a fleet, by content (app/fleet/content.py): which engines hold each
cached block, the blocks and bytes the fleet holds more than once, the merged prefix forest, and
how a prefix-aware router would score a prompt on each engine.

Built from each engine's cached blocks at one moment (`FleetIndex.build`); plain data, no I/O.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvscope_contract.prefix_forest import PrefixForest
from app.fleet.content import HASH_PREFIX, ROOT, Content, chain_ids


@dataclass(frozen=True)
class EngineCache:
    """What one engine caches, as the index needs it."""
    name: str
    block_size: int
    bytes_per_block: int
    blocks: Sequence[Content]  # one per physical block (two copies of the same content: two entries)
    # KV-cache group -> its sliding window in tokens (None: full attention); empty: one full group
    windows: Mapping[int, int | None] = field(default_factory=dict)
    evicted: Mapping[str, float] = field(default_factory=dict)  # content id -> when it left this cache


@dataclass(frozen=True)
class Score:
    engine: str
    cached_tokens: int   # the longest cached prefix, full blocks only, as a prefix-aware router scores it
    reusable_tokens: int  # what the engine itself reuses: it always computes the prompt's last token
    blocks: int


@dataclass
class FleetIndex:
    # content id -> engine -> physical copies (every KV-cache group's)
    holders: dict[str, dict[str, int]] = field(default_factory=dict)
    # content id -> KV-cache group -> engine -> physical copies: a hybrid model stores each block
    # of a prompt once per group (each group's layers), which is not duplication
    by_group: dict[str, dict[int, dict[str, int]]] = field(default_factory=dict)
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
                held = ix.by_group.setdefault(b.cid, {}).setdefault(b.kv_group, {})
                held[c.name] = held.get(c.name, 0) + 1
                if b.parent is not None or b.cid not in ix.parent:
                    ix.parent[b.cid] = b.parent
                if b.tokens:
                    ix.tokens[b.cid] = b.tokens
                ix.server_hashes.setdefault(b.cid, set()).add(b.server_hash)
        return ix

    # ------------------------------------------------------------------ duplication
    def copies(self, cid: str) -> int:
        """Physical blocks holding `cid`, fleet-wide, every group's."""
        return sum(self.holders[cid].values())

    def content_copies(self, cid: str) -> int:
        """Copies of the content `cid` fleet-wide: per engine, the most any one of its KV-cache
        groups holds (a hybrid engine's six groups storing a prompt once are one copy)."""
        per_engine: dict[str, int] = defaultdict(int)
        for held in self.by_group[cid].values():
            for e, n in held.items():
                per_engine[e] = max(per_engine[e], n)
        return sum(per_engine.values())

    def duplicated_blocks(self) -> int:
        """Physical blocks that hold content another block of the same KV-cache group holds too,
        in the fleet: every copy but one of each content in each group."""
        return sum(sum(held.values()) - 1 for groups in self.by_group.values() for held in groups.values())

    def duplicated_bytes(self) -> int:
        """The bytes of those blocks, each at its own engine's bytes per block (from its hello;
        0 for a KV-event stream, which does not say); the copy not counted is the first, in
        engine order."""
        total = 0
        for groups in self.by_group.values():
            for held in groups.values():
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
        """Every cached content once, under its parent's content id; a node's `copies` is its
        copies fleet-wide (`content_copies`; which engines hold it: `holders`). Its `holders` (the sequences
        holding it, in a single engine's forest) stays unknown: the index does not follow them."""
        f = PrefixForest()
        order = self._parents_first()
        for i, cid in enumerate(order):
            parent = self.parent.get(cid)
            node = f.store(cid, parent if parent not in (None, ROOT) else None, at=i, tokens=self.tokens.get(cid, ()))
            node.copies = self.content_copies(cid)
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
        its own block size, a hybrid engine's groups as vLLM's hit rule has them), highest first."""
        by_engine: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        for cid, groups in self.by_group.items():
            for g, held in groups.items():
                for e in held:
                    by_engine[e][g].add(cid)
        out = []
        for name, eng in self.engines.items():
            bs = eng.block_size or 1
            have = by_engine.get(name, {})
            n = _hit_blocks(chain_ids(tokens, bs), have, eng.windows, bs)
            reusable = _hit_blocks(chain_ids(tokens[:max(0, len(tokens) - 1)], bs), have, eng.windows, bs)
            out.append(Score(name, n * bs, reusable * bs, n))
        return sorted(out, key=lambda s: -s.cached_tokens)

    def route(self, tokens: Sequence[int], free_blocks: Mapping[str, int] | None = None) -> str | None:
        """The engine a prefix-aware router picks for `tokens` (see `pick`)."""
        return pick(self.score(tokens), free_blocks)


@dataclass(frozen=True)
class PromptWhy:
    """Why a prompt would not hit more on one engine, token by token (docs/misses.md, for a
    prompt typed here rather than an admission): past what the engine would reuse, each token of
    its full blocks is `evicted` (this engine cached that content and evicted it), `window` (a
    hybrid engine holds it, but a sliding window lacks its run; with one group, an earlier block of
    the chain was evicted),
    `elsewhere` (another engine holds it, at this engine's block size), or `nowhere` (no engine
    holds it); the rest of the prompt is `partial_block` (the block holding its last token is
    always computed)."""
    engine: str
    hit: int
    missed: dict[str, int]
    evicted_at: float | None = None   # the latest of those evictions
    elsewhere: tuple[str, ...] = ()   # the engines that hold what this one lacks


def why(ix: FleetIndex, engine: str, tokens: Sequence[int]) -> PromptWhy | None:
    """`tokens` (in `engine`'s own token ids) explained on `engine` (None: not in the index)."""
    eng = ix.engines.get(engine)
    if eng is None:
        return None
    bs = eng.block_size or 1
    score = next(s for s in ix.score(tokens) if s.engine == engine)
    chain = chain_ids(tokens, bs)[:max(0, len(tokens) - 1) // bs]  # the full blocks a lookup can reach
    missed: dict[str, int] = defaultdict(int)
    when, others = [], set()
    hybrid = any(w is not None for w in eng.windows.values())
    for cid in chain[score.reusable_tokens // bs:]:
        held = ix.holders.get(cid, {})
        if held.get(engine):  # held, past the hit: a window's run is gone, or (one group) a block before it
            missed["window" if hybrid else "evicted"] += bs
        elif cid in eng.evicted:
            missed["evicted"] += bs
            when.append(eng.evicted[cid])
        elif held:
            missed["elsewhere"] += bs
            others.update(held)
        else:
            missed["nowhere"] += bs
    if rest := len(tokens) - max(score.reusable_tokens, len(chain) * bs):
        missed["partial_block"] += rest
    return PromptWhy(engine, score.reusable_tokens, dict(missed), max(when, default=None), tuple(sorted(others)))


WHY_WORDS = {"evicted": "evicted", "window": "sliding window", "elsewhere": "on", "nowhere": "on no engine",
             "partial_block": "partial block"}


def why_words(w: PromptWhy, now: float | None = None) -> str:
    """'evicted 32 (12 s ago) · on b 48 · on no engine 120 · partial block 7'."""
    now = time.time() if now is None else now
    parts = []
    for k, label in WHY_WORDS.items():
        n = w.missed.get(k)
        if not n:
            continue
        if k == "elsewhere":
            parts.append(f"on {', '.join(w.elsewhere)} {n:,}")
        elif k == "evicted" and w.evicted_at is not None:
            parts.append(f"evicted {n:,} ({max(0.0, now - w.evicted_at):,.0f} s ago)")
        else:
            parts.append(f"{label} {n:,}")
    return " · ".join(parts) or "nothing: all of it hits"


def pick(scores: Sequence[Score], free_blocks: Mapping[str, int] | None = None) -> str | None:
    """The engine a prefix-aware router picks: the most cached tokens; a tie goes to the engine
    with the most free blocks, then by name."""
    free = free_blocks or {}
    best = min(scores, key=lambda s: (-s.cached_tokens, -free.get(s.engine, 0), s.engine), default=None)
    return best.engine if best else None


def _hit_blocks(chain: list[str], have: Mapping[int, set[str]], windows: Mapping[int, int | None],
                block_size: int) -> int:
    """Blocks of `chain` an engine's prefix cache serves, by vLLM's rule for KV-cache groups:
    every full-attention group holds each block from the start; a sliding-window group of W
    tokens holds the ceil((W - 1) / block_size) blocks before the hit's end (what the window
    still sees). The longest such prefix; one full-attention group when the engine names none."""
    if not have:
        return 0
    full = [g for g, w in windows.items() if w is None] if windows else list(have)
    n = len(chain)
    for g in full:
        held = have.get(g, set())
        n = min(n, next((i for i, cid in enumerate(chain) if cid not in held), len(chain)))
    sliding = {g: -(-(w - 1) // block_size) for g, w in windows.items() if w is not None}
    while n and not all(all(cid in have.get(g, ()) for cid in chain[max(0, n - k):n]) for g, k in sliding.items()):
        n -= 1
    return n
