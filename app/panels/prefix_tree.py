"""The prefix forest (kvscope_contract/prefix_forest.py) as HTML: the History panel's prefix tree
and the page of a ZMQ KV-event source draw it alike.

The view draws each root-to-leaf chain of single-child nodes as one row of chips (a shared
system prompt is one long row), and branches below it: which prompts share what, at a glance.
"""
from __future__ import annotations

from collections.abc import Callable
from html import escape

from app.ui.palette import CACHED, LIT, UNKNOWN_HASH, USED
from app.derived.words import plural
from kvscope_contract.kinds import KINDS
from kvscope_contract.prefix_forest import CACHED_ONLY, IN_USE, UNKNOWN, Node, PrefixForest

STATE_COLORS = {IN_USE: USED, CACHED_ONLY: CACHED, UNKNOWN: UNKNOWN_HASH}
VICTIM_COLOR = KINDS["evict"].color  # the next block to be evicted


# ---------------------------------------------------------------------------------- the view
CSS = """<style>
.pt { font: 13px/1.4 var(--st-font, system-ui, sans-serif); }
.pt .sum { font-size: 12px; opacity: .85; margin-bottom: 6px; }
.pt .row { display: flex; flex-wrap: wrap; align-items: center; gap: 3px; margin: 3px 0; }
.pt .kids { margin-left: 14px; padding-left: 8px; border-left: 1px dashed rgba(100,116,139,.5); }
.pt .n { position: relative; display: inline-flex; align-items: baseline; gap: 4px; max-width: 150px; height: 22px;
  padding: 0 5px; box-sizing: border-box; border-radius: 4px; color: #fff; font: 11px/22px ui-monospace, monospace;
  background: var(--c); white-space: nowrap; overflow: hidden; }
.pt .n.cached { background: repeating-linear-gradient(135deg, var(--c) 0 5px,
                                                       color-mix(in srgb, var(--c) 75%, #fff) 5px 10px);
  color: #0f172a; }
.pt .n .id { font-weight: 700; }
.pt .n .tx { overflow: hidden; text-overflow: ellipsis; opacity: .95; font-family: var(--st-font, system-ui); }
.pt .n .h { font-size: 10px; padding: 0 3px; border-radius: 6px; background: rgba(15,23,42,.55); color: #fff; }
.pt .n.victim { outline: 2px solid """ + VICTIM_COLOR + """; outline-offset: 1px; }
.pt .n.lit { outline: 3px solid """ + LIT + """; outline-offset: 1px; }
.pt .gap { font-size: 11px; opacity: .7; }
.pt .key span { display: inline-block; width: 10px; height: 10px; border-radius: 2px; vertical-align: -1px;
                margin: 0 3px 0 8px; }
</style>"""


def _chip(node: Node, victim: str | None, lit: set[int], text: str, color: str | None = None,
          groups: int = 0, victim_group: int | None = None) -> str:
    """A node's chip; on a hybrid pool (`groups` KV-cache groups) its title lists each group's block
    and a badge says when only some groups cache it (a hit needs every group that reads it)."""
    blocks = node.blocks.values() if node.blocks else [node.block] if node.block is not None else []
    cls = "n" + (" cached" if node.state == CACHED_ONLY else "") + (" victim" if node.key == victim else "") \
        + (" lit" if any(b in lit for b in blocks) else "")
    name = f"{node.block}" if node.block is not None else node.key[:6]
    held = f"×{node.holders}" if node.holders and node.holders > 1 else ""
    title = " · ".join(x for x in (
        f"block {node.block}" if node.block is not None else "", f"hash {node.key}",
        f"parent {node.parent}" if node.parent else "first block of a prompt",
        "" if node.state == UNKNOWN else node.state + (f" by {node.holders}" if node.holders else ""),
        f"{node.copies} copies of the same content" if node.copies > 1 and not node.blocks else "",
        "blocks by KV-cache group: " + ", ".join(
            f"group {g}: {b}" + ("" if node.held.get(g) else " (cached only)") for g, b in sorted(node.blocks.items()))
        if node.blocks else "",
        "" if node.state == UNKNOWN else f"{node.hits} hits",
        f"stored at {node.stored:g}", f"on {node.medium}" if node.medium else "",
        ("next to be evicted" + (f" (group {victim_group}'s block)" if node.blocks else "")) if node.key == victim
        else "", repr(text) if text else "") if x)
    return (f'<span class="{cls}" style="--c:{color or STATE_COLORS[node.state]}" title="{escape(title)}">'
            f'<span class="id">{escape(name)}{held}</span>'
            + (f'<span class="tx">{escape(text)}</span>' if text else "")
            + (f'<span class="h">{plural(node.hits, "hit")}</span>' if node.hits else "")
            + (f'<span class="h">×{node.copies} copies</span>' if node.copies > 1 and not node.blocks else "")
            + (f'<span class="h">{len(node.blocks)}/{groups} groups</span>' if node.blocks and len(node.blocks) < groups
               else "")
            + "</span>")


def render(forest: PrefixForest, highlight: set[int] | frozenset[int] = frozenset(), max_nodes: int = 400,
           max_chain: int = 24, text: Callable[[Node], str] = lambda n: n.label,
           color: Callable[[Node], str] | None = None, groups: int = 1) -> str:
    """The forest as HTML: one row per chain, branches indented below their parent's row; a
    chip shows `text(node)` (its label unless told), coloured by `color(node)` (its state unless told).
    `groups`: the pool's KV-cache groups (a hybrid pool's nodes carry a block per group)."""
    stats, victim = forest.stats(), forest.victim
    if not forest.nodes:
        return CSS + ('<div class="pt"><div class="sum">The prefix cache is empty: full blocks are registered '
                      'here as prompts are computed (with prefix caching on).</div></div>')
    out: list[str] = []
    shown = 0

    def chip(n: Node) -> str:
        return _chip(n, victim, highlight, text(n), color(n) if color else None, groups, forest.victim_group)

    def branch(node: Node) -> None:
        nonlocal shown
        run = forest.chain(node)
        chips = [chip(n) for n in run[:max_chain]]
        if len(run) > max_chain:
            chips.insert(max_chain // 2, f'<span class="gap">… {len(run) - max_chain} more …</span>')
            chips = chips[:max_chain // 2 + 1] + [chip(n) for n in run[-(max_chain // 2):]]
        shown += len(run)
        out.append(f'<div class="row">{"".join(chips)}</div>')
        kids = forest.kids(run[-1])
        if kids:
            out.append('<div class="kids">')
            for kid in kids:
                if shown >= max_nodes:
                    out.append(f'<div class="gap">… {plural(stats["blocks"] - shown, "more block")}</div>')
                    break
                branch(kid)
            out.append("</div>")

    for root in forest.roots():
        if shown >= max_nodes:
            out.append(f'<div class="gap">… {plural(stats["blocks"] - shown, "more block")}</div>')
            break
        branch(root)
    summary = (f'<b>{plural(stats["blocks"], "cached block")}</b> in '
               f'<b>{plural(stats["roots"], "prefix", "prefixes")}</b>')
    if groups > 1:
        summary += (f' · {stats["copies"]:,} physical blocks in {groups} KV-cache groups (each group caches its own '
                    'block under the same hash; a hit needs every group that reads it)')
    elif stats["copies"] > stats["blocks"]:
        summary += f' · {stats["copies"]:,} physical blocks (the same content cached more than once)'
    if stats["in use"] + stats["cached only"]:  # the source reports holders
        key = "".join(f'<span style="background:{STATE_COLORS[s]}"></span>{s}' for s in (IN_USE, CACHED_ONLY)) \
            + f'<span style="background:none;outline:2px solid {VICTIM_COLOR}"></span>next evicted'
        summary += (f' · {stats["in use"]:,} in use · {stats["cached only"]:,} cached only · {stats["hits"]:,} hits'
                    f'<span class="key">{key}</span>')
    else:
        summary += " · holders, hits and the eviction order unknown (the source does not say)"
    return CSS + f'<div class="pt"><div class="sum">{summary}</div>{"".join(out)}</div>'
