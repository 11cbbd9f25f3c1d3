"""Block tables at any scale: for each live sequence, logical block i -> physical block, in the
grid's colours, with its prompt and output parts, shared and copied blocks marked, host blocks
while swapped out, and its text streaming beside it.

A few sequences are shown whole, as cards. With many, the cards are those first in the chosen
order (search and sort above them), and every matching sequence is listed below (scrolled
virtually); a click in the list pins that sequence's card on top (the panel around them:
app/panels/tables_panel.py). A long table is drawn compressed: runs of consecutive block ids as one chip each, which
open to their blocks.
"""
from __future__ import annotations

from html import escape

import numpy as np

from app.link.client import View
from app.history.groups import Row, held_blocks, host_blocks, span, table_rows
from app.history.mirror import Finished
from app.ui.palette import ACCENT, INK, LIT, RESERVED, STATUS_COLORS, seq_color
from app.derived.words import plural
from kvscope_contract.kinds import KINDS
from kvscope_contract.state import NULL, SeqState

CSS = """<style>
.bt { font: 13px/1.4 var(--st-font, system-ui, sans-serif); }
.bt .key { font-size: 12px; opacity: .8; margin-bottom: 8px; }
.bt .seq { margin: 0 0 10px; padding: 6px 8px; border-left: 4px solid var(--c); border-radius: 4px;
  background: color-mix(in srgb, var(--c) 6%, transparent); }
.bt .seq.pin { box-shadow: 0 0 0 2px """ + ACCENT + """ inset; }
.bt .top { display: flex; gap: 8px; align-items: baseline; flex-wrap: wrap; }
.bt .id { font-weight: 700; }
.bt .st { font-size: 11px; padding: 0 6px; border-radius: 8px; }
""" + "".join(f".bt .st{'' if k == 'other' else '.' + k} {{ background: {bg}; color: {fg}; }}\n"
              for k, (bg, fg) in STATUS_COLORS.items()) + """.bt .meta { font-size: 12px; opacity: .75; }
.bt .chips { display: flex; flex-wrap: wrap; gap: 3px; margin: 5px 0 3px; align-items: flex-start; }
.bt .ch { position: relative; min-width: 30px; height: 24px; padding: 0 3px; box-sizing: border-box;
  border-radius: 3px; color: #fff; font: 600 11px/24px ui-monospace, monospace; text-align: center;
  background: linear-gradient(to top, var(--c) var(--f), color-mix(in srgb, var(--c) 35%, transparent) var(--f)); }
.bt .ch::after { content: ""; position: absolute; left: 0; right: 0; bottom: -3px; height: 2px;
  background: linear-gradient(to right, """ + RESERVED + """ var(--p), var(--c) var(--p)); }
.bt .ch .li { position: absolute; left: 2px; top: -1px; font-size: 8px; line-height: 9px; opacity: .8;
              font-weight: 400; }
.bt .ch .mk { position: absolute; right: 2px; top: 2px; width: 7px; height: 7px; border-radius: 50%;
  border: 1px solid #fff; box-sizing: border-box; }
.bt .dot { display: inline-block; width: 8px; height: 8px; border-radius: 50%; vertical-align: 0; }
.bt .ch.shared { outline: 2px solid """ + INK + """; outline-offset: -2px; }
.bt .ch.lit { box-shadow: 0 0 0 3px """ + LIT + """; }
.bt .ch.host { border: 1px dashed var(--c); color: var(--c); background: transparent; }
.bt .ch.run { padding: 0 6px 0 12px; }
.bt .ch.null { background: transparent; border: 1px dashed #94a3b8; color: #64748b; font-weight: 400;
  padding: 0 6px 0 12px; }
.bt .ch.null::after { display: none; }
.bt .grp { display: flex; gap: 6px; align-items: flex-start; }
.bt .grp .gl { flex: 0 0 auto; width: 84px; font-size: 11px; line-height: 1.25; margin-top: 6px; opacity: .8;
  overflow: hidden; text-overflow: ellipsis; }
.bt .grp .chips { flex: 1 1 auto; }
.bt .opened { flex-basis: 100%; display: flex; flex-wrap: wrap; gap: 3px; margin: 2px 0 4px;
  padding-left: 6px; border-left: 2px solid """ + ACCENT + """; }
.bt .txt { font-size: 12.5px; white-space: pre-wrap; word-break: break-word; opacity: .9; max-height: 5.6em;
  overflow: hidden; display: flex; flex-direction: column-reverse; }
.bt .more { opacity: .7; font-size: 12px; }
.bt .fin .seq { opacity: .85; }
</style>"""
KEY = ('<div class="key">each chip: <b>physical block</b> (small: logical index) · fill = tokens held · '
       'dark underline = prompt part · <b>×n</b> shared (outlined) · '
       f'<span class="dot" style="background:{KINDS["prefix_hit"].color}"></span> from the prefix cache · '
       f'<span class="dot" style="background:{KINDS["cow"].color}"></span> copied on write · '
       '<b>H</b> host block while swapped out · <b>a–b</b> a run of consecutive blocks (<i>Open runs</i> '
       'lists their blocks)</div>')
KEY_GROUPS = ('<div class="key">a row per KV-cache group (groups whose tables look alike share one: <b>×n</b>; '
              '<i>Every KV-cache group</i> shows each) · <span class="ch null" style="display:inline-block;height:auto;'
              'line-height:1.3">∅</span> no block: the sliding window has passed it, freed '
              f'(<span class="dot" style="background:{KINDS["window_free"].color}"></span> left the window)</div>')
KEY_TIER = ('<div class="key"><span class="dot" style="background:' + KINDS["offload_load"].color + '"></span> '
            'loaded from the host tier: the device missed it, the host tier had it (copied back, not recomputed)</div>')
# how a chip says where its block came from, in the order a run of several says the first found
ORIGIN_WORDS = {"prefix_hit": " · from the prefix cache", "offload_load": " · loaded from the host tier",
                "cow": " · copied on write"}
STATUS_ORDER = {"running": 0, "swapped": 1, "waiting": 2}
SORTS = {
    "blocks held": lambda s: (-(held_blocks(s) + host_blocks(s)), s.key),
    "age": lambda s: s.key,  # creation order: the oldest first
    "status": lambda s: (STATUS_ORDER.get(s.status, 3), -held_blocks(s), s.key),
}
ALL_CARDS = 12     # this many matching sequences or fewer: every one as a card, no list
CARDS = 5          # otherwise the first few in the chosen order
PLAIN = 32         # tables up to this many blocks show every block (runs are for long ones)
MAX_RUNS = 64      # chips per card before "+N more"
MAX_OPEN = 256     # blocks shown when a run opens


def runs(table: list[int]) -> list[tuple[int, int]]:
    """(first logical index, length) of each run of consecutive block ids in `table`, rising or
    falling (the allocator hands out freed blocks tail first); NULL entries (no block) make runs
    of their own."""
    out, start, step = [], 0, None
    for i in range(1, len(table) + 1):
        if i < len(table):
            a, b = table[i - 1], table[i]
            d = 0 if a == b == NULL else None if NULL in (a, b) else b - a
            if i - start == 1 and (d == 0 or d in (1, -1)):
                step = d
                continue
            if d is not None and d == step:
                continue
        out.append((start, i - start))
        start, step = i, None
    return out


def _chip(color: str, label: str, index: int, fill: float, prompt: float, title: str,
          cls: str = "", mark: str = "") -> str:
    return (f'<span class="ch {cls}" style="--c:{color};--f:{fill:.0%};--p:{prompt:.0%}" title="{escape(title)}">'
            f'<span class="li">{index}</span>{label}'
            f'{f"<span class=mk style=background:{mark}></span>" if mark else ""}</span>')


class _Card:
    """One row of a sequence's chips: a group's device (or, swapped out, host) table; on a
    hybrid pool `row` names the groups it stands for (their blocks told in each chip's title)."""

    def __init__(self, view: View, s: SeqState, color: str, open_runs: bool = False,
                 highlight: set[int] = frozenset(), row: Row = Row((0,), "")):
        self.pool, self.s, self.color, self.open_runs = view.mirror.state, s, color, open_runs
        self.highlight = highlight
        self.bs = view.mirror.config.block_size
        self.g, self.alike = row.groups[0], row.groups[1:]
        self.window = view.mirror.config.groups[self.g].window
        self.origins = {i: o for (g, i), o in view.mirror.origins.get(s.seq_id, {}).items() if g == self.g}
        self.host = not any(s.block_tables) and any(s.host_tables)
        self.tables = s.host_tables if self.host else s.block_tables
        self.table = self.tables[self.g]

    def prompt(self, i: int, n: int = 1) -> float:
        return min(1.0, max(0.0, (self.s.prompt_tokens - i * self.bs) / (n * self.bs)))

    def held(self, i: int, n: int = 1) -> int:
        """Tokens in blocks i..i+n of the table, as the pool state holds them (the grid's hover
        reads the same column)."""
        column = self.pool.host_tokens if self.host else self.pool.tokens
        return int(column[self.table[i:i + n]].sum(dtype=np.int64))

    def others(self, i: int) -> str:
        """Entry i of the groups alike, in a chip's title."""
        if not self.alike:
            return ""
        return " · groups " + ", ".join(f"{g}: {self.tables[g][i]}" for g in self.alike if i < len(self.tables[g]))

    def block(self, i: int) -> str:
        b, bs, held, prompt = self.table[i], self.bs, self.held(i), self.prompt(i)
        part = "prompt" if prompt >= 1 else "output" if prompt <= 0 else "prompt + output"
        if self.host:
            return _chip(self.color, f"H{b}", i, 0, prompt, f"logical {i} → host block {b} · {held}/{bs} tokens, "
                         "swapped out" + self.others(i), "host")
        ref, origin = int(self.pool.ref_counts[b]), self.origins.get(i, "")
        title = (f"logical {i} → physical block {b} · {held}/{bs} tokens · {part}"
                 + (f" · shared by {ref}" if ref > 1 else "")
                 + ORIGIN_WORDS.get(origin, "")
                 + self.others(i))
        label = f"{b}" + (f"<sup>×{ref}</sup>" if ref > 1 else "")
        cls = ("shared " if ref > 1 else "") + ("lit" if b in self.highlight else "")
        return _chip(self.color, label, i, held / bs, prompt, title, cls, KINDS[origin].color if origin else "")

    def empty(self, i: int, n: int) -> str:
        """Entries i..i+n without a block: a sliding window has passed them (freed as it moved:
        "left the window"), or a prefix hit had no need of them."""
        left = sum(self.origins.get(j) == "window_free" for j in range(i, i + n))
        where = f"{i}" if n == 1 else f"{i}–{i + n - 1}"
        label = "∅" if n == 1 else f"{where} ∅"
        why = (f"the sliding window of {self.window} tokens has passed {'it' if n == 1 else 'them'}"
               if self.window else "no block")
        said = ("left the window: freed as it moved" if left == n else
                f"{left} left the window as it moved, {n - left} before it (a prefix hit had no need of them)"
                if left else "outside the window when the sequence was admitted: never needed")
        title = f"logical {where}: no block ({NULL}) · {why} · {said}"
        return _chip("#94a3b8", label, i, 0, 0, title, "null", KINDS["window_free"].color if left else "")

    def run(self, i: int, n: int) -> str:
        if n < 3:
            return "".join(self.block(j) for j in range(i, i + n))
        first, last = self.table[i], self.table[i + n - 1]
        lo, hi = min(first, last), max(first, last)
        shared = 0 if self.host else int((self.pool.ref_counts[lo:hi + 1] > 1).sum())
        origins = {self.origins[j] for j in range(i, i + n) if j in self.origins}
        mark = next((KINDS[k].color for k in ORIGIN_WORDS if k in origins), "")
        label = ("H" if self.host else "") + f"{first}–{last}"  # ×n means a ref count elsewhere: not here
        alike = (" · groups " + ", ".join(f"{g}: {self.tables[g][i]}–{self.tables[g][i + n - 1]}" for g in self.alike)
                 if self.alike else "")
        title = (f"logical {i}–{i + n - 1} → {'host' if self.host else 'physical'} blocks {first}–{last}: {n} blocks, "
                 f"{self.held(i, n)}/{n * self.bs} tokens" + (f", {shared} shared" if shared else "") + alike)
        chip = _chip(self.color, label, i, 0 if self.host else self.held(i, n) / (n * self.bs), self.prompt(i, n),
                     title, "run host" if self.host else "run shared" if shared else "run", mark)
        lit = not self.host and any(self.table[j] in self.highlight for j in range(i, i + n))
        if not (self.open_runs or lit):  # a run holding a highlighted block opens by itself
            return chip
        inner = "".join(self.block(j) for j in range(i, i + min(n, MAX_OPEN)))
        more = f'<span class="more">+{n - MAX_OPEN} more</span>' if n > MAX_OPEN else ""
        return f'<div class="opened">{chip}{inner}{more}</div>'

    def chips(self) -> str:
        """Every entry as a chip, or (long tables) runs of consecutive blocks; entries without a
        block always one chip per run of them."""
        parts = runs(self.table)
        blocks = len(self.table) - sum(n for i, n in parts if self.table[i] == NULL)
        plain = blocks <= PLAIN
        out, shown = [], 0
        for i, n in parts:
            if shown == MAX_RUNS and not plain:
                rest = [(j, m) for j, m in parts if j >= i]
                out.append(f'<span class="more">+{len(rest)} more runs ({sum(m for _, m in rest)} entries)</span>')
                break
            if self.table[i] == NULL:
                out.append(self.empty(i, n))
            elif plain:
                out.extend(self.block(j) for j in range(i, i + n))
            else:
                out.append(self.run(i, n))
            shown += 1
        return "".join(out)


def meta(s: SeqState, block_size: int) -> str:
    """The tokens a sequence has in the cache, and those it still needs computed (a waiting
    prompt, or a sequence preempted by recompute) with the blocks they take."""
    known = s.prompt_tokens + s.output_tokens  # every token it has: prompt, and output sampled so far
    table, held, host = s.block_table, held_blocks(s), host_blocks(s)
    where = (plural(held, "block") if held else plural(host, "host block") if host else "no blocks")
    if len(s.block_tables) > 1:
        where += f" in {len(s.block_tables)} groups"
    if s.num_tokens + 1 >= known:  # all in the cache, but for the token sampled last
        return (f"{s.num_tokens:,} tokens = {min(s.prompt_tokens, s.num_tokens):,} prompt + "
                f"{max(0, s.num_tokens - s.prompt_tokens):,} output (max {s.max_tokens:,}) · {where}")
    todo = known - s.num_tokens
    verb = "to recompute" if s.output_tokens else "to compute"
    need = -(-known // block_size)
    return (f"{s.num_tokens:,} of {known:,} tokens in the cache ({s.prompt_tokens:,} prompt + "
            f"{s.output_tokens:,} output, max {s.max_tokens:,}) · {todo:,} {verb} · {where}"
            + (f", needs {plural(need, 'block')} of {block_size}" if len(s.block_tables) == 1 and len(table) < need
               else ""))


def card(view: View, s: SeqState, colors: dict[str, int], pinned: bool = False, open_runs: bool = False,
         highlight: set[int] = frozenset(), every_group: bool = False) -> str:
    """A sequence's card: its tables (a row per KV-cache group on a hybrid pool, groups alike
    sharing one unless `every_group`) and its text."""
    color = seq_color(colors.get(s.seq_id, 0))
    text = escape(s.text[-600:]) + ("▌" if s.status == "running" and view.live else "")
    host = not any(s.block_tables) and any(s.host_tables)
    rows = table_rows(view.mirror.state, s, view.mirror.origins.get(s.seq_id, {}), every_group, host)
    chips = "".join(
        f'<div class="grp"><span class="gl" title="{escape(_row_title(view, row))}">'
        f'{"<br>".join(map(escape, row.label.split(" · ")))}</span>'
        f'<div class="chips">{_Card(view, s, color, open_runs, highlight, row).chips()}</div></div>' if row.label
        else f'<div class="chips">{_Card(view, s, color, open_runs, highlight, row).chips()}</div>' for row in rows)
    return (f'<div class="seq{" pin" if pinned else ""}" style="--c:{color}"><div class="top">'
            f'<span class="id">{escape(s.seq_id)}</span><span class="st {s.status}">{s.status}</span>'
            f'<span class="meta">{meta(s, view.mirror.config.block_size)}</span></div>'
            f'{chips}<div class="txt"><span>{text}</span></div></div>')


def _row_title(view: View, row: Row) -> str:
    groups = view.mirror.config.groups
    g = groups[row.groups[0]]
    kind = (f"sliding window: each layer attends to its last {g.window} tokens" if g.window
            else "full attention: each layer attends to every token")
    layers = sorted(x for k in row.groups for x in groups[k].layers)
    return (f"KV-cache group{'s' if len(row.groups) > 1 else ''} {span(list(row.groups))} · {kind}"
            + (f" · layers {', '.join(map(str, layers))}" if layers else "")
            + (" · their tables alike: the chips show the first group's blocks, each chip's title the others'"
               if len(row.groups) > 1 else ""))


def chosen(view: View, query: str = "", sort: str = "status") -> list[SeqState]:
    """The live sequences whose id or request id contains `query`, in the `sort` order."""
    q = query.strip().lower()
    seqs = [s for s in view.mirror.state.seqs.values()
            if not q or q in s.seq_id.lower() or q in s.request_id.lower()]
    return sorted(seqs, key=SORTS[sort])


def render(view: View, colors: dict[str, int], seqs: list[SeqState] | None = None, pinned: str | None = None,
           open_runs: bool = False, highlight: set[int] = frozenset(), every_group: bool = False) -> str:
    """The cards of `seqs` (default: every live sequence, by status), `pinned` first; with
    `open_runs`, each run of consecutive blocks also lists its blocks; `highlight`: device
    blocks to ring (a lesson's stop points at them); `every_group`: a row per KV-cache group."""
    seqs = chosen(view) if seqs is None else seqs
    if not seqs:
        live = len(view.mirror.state.seqs)
        say = (f"None of the {live:,} live sequences matches the search." if live else
               "No live sequence: submit a prompt or run a scenario.")
        return CSS + f'<div class="bt"><div class="meta">{say}</div></div>'
    pin = view.mirror.state.seqs.get(pinned) if pinned else None
    cards = ([card(view, pin, colors, True, open_runs, highlight, every_group)] if pin else []) + [
        card(view, s, colors, False, open_runs, highlight, every_group) for s in seqs if s is not pin]
    key = (KEY + (KEY_GROUPS if len(view.mirror.config.groups) > 1 else "")
           + (KEY_TIER if view.mirror.config.num_offload_blocks else ""))
    return CSS + f'<div class="bt" data-event="{view.event}">{key}{"".join(cards)}</div>'


LIST_COLUMNS = ["sequence", "status", "blocks", "host blocks", "tokens", "prompt", "output", "age (s)"]


def listing(view: View, seqs: list[SeqState]) -> list[list]:
    """One row per sequence, for the scrolled list (its columns: LIST_COLUMNS)."""
    now = view.mirror.t
    return [[s.seq_id, s.status, held_blocks(s), host_blocks(s), s.num_tokens, s.prompt_tokens,
             s.output_tokens, None if s.added is None else round(now - s.added, 1)] for s in seqs]


def render_finished(finished: list[Finished], colors: dict[str, int]) -> str:
    if not finished:
        return CSS + '<div class="bt"><div class="meta">No request has finished yet.</div></div>'
    reasons = {"stop": "stopped (end of text)", "length": "reached max tokens", "abort": "aborted",
               "error": "failed"}
    rows = [f'<div class="seq" style="--c:{seq_color(colors.get(f.seq_id, 0))}"><div class="top">'
            f'<span class="id">{escape(f.seq_id)}</span><span class="st">{reasons.get(f.reason, f.reason)}</span>'
            f'<span class="meta">{f.output_tokens} output tokens</span></div>'
            f'<div class="txt"><span>{escape(f.text[-600:])}</span></div></div>' for f in reversed(finished)]
    return CSS + f'<div class="bt fin">{"".join(rows)}</div>'
