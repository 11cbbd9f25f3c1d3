"""The prefix cache as a forest: each cached block a node under its parent's hash, and its view.

The model knows nothing of where its blocks come from. KVScope's own events feed it through
`app/prefix_events.py`; a vLLM / SGLang KV-event stream (BlockStored / BlockRemoved /
AllBlocksCleared) can feed it through the same four calls: `store`, `remove`, `clear`, and,
where the source knows them, `hold` (how many sequences hold a block) and `hit`.

The view draws each root-to-leaf chain of single-child nodes as one row of chips (a shared
system prompt is one long row), and branches below it: which prompts share what, at a glance.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from html import escape

from app.palette import CACHED

IN_USE, CACHED_ONLY, UNKNOWN = "in use", "cached only", "stored"
STATE_COLORS = {IN_USE: "#4e79a7", CACHED_ONLY: CACHED, UNKNOWN: "#0f766e"}
VICTIM_COLOR = "#dc2626"


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

    @property
    def state(self) -> str:
        return UNKNOWN if self.holders is None else IN_USE if self.holders else CACHED_ONLY


class PrefixForest:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        # parent hash -> child hashes, whether or not the parent is cached (it may come back)
        self.children: dict[str, list[str]] = {}
        # cached-only nodes, least recently released first: the eviction order (for sources that
        # report holders)
        self.lru: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ changes
    def store(self, key: str, parent: str | None, label: str = "", *, block: int | None = None,
              medium: str | None = None, holders: int | None = None, at: float = 0) -> Node:
        """A block enters the cache (again: its fields are replaced, its hit count kept)."""
        old = self.nodes.get(key)
        if old is not None and old.parent != parent:
            self._unlink(old)
        node = self.nodes[key] = Node(key, parent, label, block, medium, None, old.hits if old else 0, at)
        if parent is not None and (old is None or old.parent != parent):
            self.children.setdefault(parent, []).append(key)
        self.hold(key, holders)
        return node

    def remove(self, key: str) -> None:
        """A block leaves the cache (evicted); its children stay, under a parent no longer cached."""
        node = self.nodes.pop(key, None)
        if node is not None:
            self._unlink(node)
            self.lru.pop(key, None)

    def clear(self) -> None:
        self.nodes.clear()
        self.children.clear()
        self.lru.clear()

    def hold(self, key: str, holders: int | None) -> None:
        """How many sequences hold the block now: at 0 it becomes the most recently used of the
        cached-only blocks, the last to be evicted."""
        node = self.nodes.get(key)
        if node is None:
            return
        node.holders = holders
        self.lru.pop(key, None)
        if holders == 0:
            self.lru[key] = None

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
        """The cached-only block evicted next when a block is needed and none is free."""
        return next(iter(self.lru), None)

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

    def stats(self) -> dict[str, int]:
        states = [n.state for n in self.nodes.values()]
        return {"blocks": len(self.nodes), "roots": len(self.roots()), "in use": states.count(IN_USE),
                "cached only": states.count(CACHED_ONLY), "hits": sum(n.hits for n in self.nodes.values()),
                "leaves": sum(1 for n in self.nodes.values() if not self.kids(n))}


# ---------------------------------------------------------------------------------- the view
CSS = """<style>
.pt { font: 13px/1.4 var(--st-font, system-ui, sans-serif); }
.pt .sum { font-size: 12px; opacity: .85; margin-bottom: 6px; }
.pt .row { display: flex; flex-wrap: wrap; align-items: center; gap: 3px; margin: 3px 0; }
.pt .kids { margin-left: 14px; padding-left: 8px; border-left: 1px dashed rgba(100,116,139,.5); }
.pt .n { position: relative; display: inline-flex; align-items: baseline; gap: 4px; max-width: 150px; height: 22px;
  padding: 0 5px; box-sizing: border-box; border-radius: 4px; color: #fff; font: 11px/22px ui-monospace, monospace;
  background: var(--c); white-space: nowrap; overflow: hidden; }
.pt .n.cached { background: repeating-linear-gradient(135deg, var(--c) 0 5px, color-mix(in srgb, var(--c) 75%, #fff) 5px 10px);
  color: #0f172a; }
.pt .n .id { font-weight: 700; }
.pt .n .tx { overflow: hidden; text-overflow: ellipsis; opacity: .95; font-family: var(--st-font, system-ui); }
.pt .n .h { font-size: 10px; padding: 0 3px; border-radius: 6px; background: rgba(15,23,42,.55); color: #fff; }
.pt .n.victim { outline: 2px solid """ + VICTIM_COLOR + """; outline-offset: 1px; }
.pt .n.lit { outline: 3px solid #f59e0b; outline-offset: 1px; }
.pt .gap { font-size: 11px; opacity: .7; }
.pt .key span { display: inline-block; width: 10px; height: 10px; border-radius: 2px; vertical-align: -1px; margin: 0 3px 0 8px; }
</style>"""


def _chip(node: Node, victim: str | None, lit: set[int]) -> str:
    cls = "n" + (" cached" if node.state == CACHED_ONLY else "") + (" victim" if node.key == victim else "") \
        + (" lit" if node.block is not None and node.block in lit else "")
    name = f"{node.block}" if node.block is not None else node.key[:6]
    held = f"×{node.holders}" if node.holders and node.holders > 1 else ""
    title = " · ".join(x for x in (
        f"block {node.block}" if node.block is not None else "", f"hash {node.key}",
        f"parent {node.parent}" if node.parent else "first block of a prompt",
        node.state + (f" by {node.holders}" if node.holders else ""), f"{node.hits} hits",
        f"stored at {node.stored:g}", f"on {node.medium}" if node.medium else "",
        "next to be evicted" if node.key == victim else "", repr(node.label) if node.label else "") if x)
    return (f'<span class="{cls}" style="--c:{STATE_COLORS[node.state]}" title="{escape(title)}">'
            f'<span class="id">{escape(name)}{held}</span>'
            + (f'<span class="tx">{escape(node.label)}</span>' if node.label else "")
            + (f'<span class="h">{node.hits} hit{"s" if node.hits != 1 else ""}</span>' if node.hits else "")
            + "</span>")


def render(forest: PrefixForest, highlight: set[int] | frozenset[int] = frozenset(), max_nodes: int = 400,
           max_chain: int = 24) -> str:
    """The forest as HTML: one row per chain, branches indented below their parent's row."""
    stats, victim = forest.stats(), forest.victim
    if not forest.nodes:
        return CSS + ('<div class="pt"><div class="sum">The prefix cache is empty: full blocks are registered '
                      'here as prompts are computed (with prefix caching on).</div></div>')
    out: list[str] = []
    shown = 0

    def branch(node: Node) -> None:
        nonlocal shown
        run = forest.chain(node)
        chips = [_chip(n, victim, highlight) for n in run[:max_chain]]
        if len(run) > max_chain:
            chips.insert(max_chain // 2, f'<span class="gap">… {len(run) - max_chain} more …</span>')
            chips = chips[:max_chain // 2 + 1] + [_chip(n, victim, highlight) for n in run[-(max_chain // 2):]]
        shown += len(run)
        out.append(f'<div class="row">{"".join(chips)}</div>')
        kids = forest.kids(run[-1])
        if kids:
            out.append('<div class="kids">')
            for kid in kids:
                if shown >= max_nodes:
                    out.append(f'<div class="gap">… {stats["blocks"] - shown} more blocks</div>')
                    break
                branch(kid)
            out.append("</div>")

    for root in forest.roots():
        if shown >= max_nodes:
            out.append(f'<div class="gap">… {stats["blocks"] - shown} more blocks</div>')
            break
        branch(root)
    key = "".join(f'<span style="background:{STATE_COLORS[s]}"></span>{s}' for s in (IN_USE, CACHED_ONLY)) \
        + f'<span style="background:none;outline:2px solid {VICTIM_COLOR}"></span>next evicted'
    summary = (f'<b>{stats["blocks"]:,}</b> cached blocks in <b>{stats["roots"]:,}</b> prefixes · '
               f'{stats["in use"]:,} in use · {stats["cached only"]:,} cached only · {stats["hits"]:,} hits'
               f'<span class="key">{key}</span>')
    return CSS + f'<div class="pt"><div class="sum">{summary}</div>{"".join(out)}</div>'
