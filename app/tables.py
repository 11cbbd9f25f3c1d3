"""Block tables: for every live sequence, logical block i -> physical block, in the grid's
colours, with its prompt and output parts, shared and copied blocks marked, host blocks
while swapped out, and the sequence's text streaming beside it."""
from __future__ import annotations

from html import escape

from app.client import View
from app.mirror import Finished
from engine.contract.kinds import KINDS
from engine.contract.state import held_tokens
from app.palette import seq_color

CSS = """<style>
.bt { font: 13px/1.4 var(--st-font, system-ui, sans-serif); }
.bt .key { font-size: 12px; opacity: .8; margin-bottom: 8px; }
.bt .seq { margin: 0 0 10px; padding: 6px 8px; border-left: 4px solid var(--c); border-radius: 4px;
  background: color-mix(in srgb, var(--c) 6%, transparent); }
.bt .top { display: flex; gap: 8px; align-items: baseline; flex-wrap: wrap; }
.bt .id { font-weight: 700; }
.bt .st { font-size: 11px; padding: 0 6px; border-radius: 8px; background: #e2e8f0; color: #334155; }
.bt .st.running { background: #dcfce7; color: #166534; } .bt .st.swapped { background: #ede9fe; color: #5b21b6; }
.bt .st.waiting { background: #fef3c7; color: #92400e; }
.bt .meta { font-size: 12px; opacity: .75; }
.bt .chips { display: flex; flex-wrap: wrap; gap: 3px; margin: 5px 0 3px; }
.bt .ch { position: relative; min-width: 30px; height: 24px; padding: 0 3px; box-sizing: border-box;
  border-radius: 3px; color: #fff; font: 600 11px/24px ui-monospace, monospace; text-align: center;
  background: linear-gradient(to top, var(--c) var(--f), color-mix(in srgb, var(--c) 35%, transparent) var(--f)); }
.bt .ch::after { content: ""; position: absolute; left: 0; right: 0; bottom: -3px; height: 2px;
  background: linear-gradient(to right, #334155 var(--p), var(--c) var(--p)); }
.bt .ch .li { position: absolute; left: 2px; top: -1px; font-size: 8px; line-height: 9px; opacity: .8; font-weight: 400; }
.bt .ch .mk { position: absolute; right: 2px; top: 2px; width: 7px; height: 7px; border-radius: 50%;
  border: 1px solid #fff; box-sizing: border-box; }
.bt .dot { display: inline-block; width: 8px; height: 8px; border-radius: 50%; vertical-align: 0; }
.bt .ch.shared { outline: 2px solid #0f172a; outline-offset: -2px; }
.bt .ch.lit { box-shadow: 0 0 0 3px #f59e0b; }
.bt .ch.host { border: 1px dashed var(--c); color: var(--c); background: transparent; }
.bt .txt { font-size: 12.5px; white-space: pre-wrap; word-break: break-word; opacity: .9; max-height: 5.6em;
  overflow: hidden; display: flex; flex-direction: column-reverse; }
.bt .more { opacity: .7; font-size: 12px; }
.bt .fin .seq { opacity: .85; }
</style>"""
KEY = ('<div class="key">each chip: <b>physical block</b> (small: logical index) · fill = tokens held · '
       'dark underline = prompt part · <b>×n</b> shared (outlined) · '
       f'<span class="dot" style="background:{KINDS["prefix_hit"].color}"></span> from the prefix cache · '
       f'<span class="dot" style="background:{KINDS["cow"].color}"></span> copied on write · '
       '<b>H</b> host block while swapped out</div>')
ORDER = {"running": 0, "swapped": 1, "waiting": 2}


def _chip(color: str, label: str, index: int, fill: float, prompt: float, title: str,
          cls: str = "", mark: str = "") -> str:
    return (f'<span class="ch {cls}" style="--c:{color};--f:{fill:.0%};--p:{prompt:.0%}" title="{escape(title)}">'
            f'<span class="li">{index}</span>{label}'
            f'{f"<span class=mk style=background:{mark}></span>" if mark else ""}</span>')


def render(view: View, colors: dict[str, int], max_seqs: int = 24, max_chips: int = 96,
           highlight: set[int] = frozenset()) -> str:
    """`highlight`: device blocks to ring (a lesson's stop points at them)."""
    st, bs = view.mirror.state, view.mirror.config.block_size
    seqs = sorted(st.seqs.values(), key=lambda s: ORDER.get(s.status, 3))
    if not seqs:
        return CSS + '<div class="bt"><div class="meta">No live sequence: submit a prompt or run a scenario.</div></div>'
    rows = []
    for s in seqs[:max_seqs]:
        color = seq_color(colors.get(s.seq_id, 0))
        origins = view.mirror.origins.get(s.seq_id, {})
        chips = []
        table, host = s.block_table, s.host_table
        for i, b in enumerate((table or host)[:max_chips]):
            held = held_tokens(s.num_tokens, i, bs)
            prompt = min(1.0, max(0.0, (s.prompt_tokens - i * bs) / bs))
            part = "prompt" if prompt >= 1 else "output" if prompt <= 0 else "prompt + output"
            if table:
                ref, origin = st.ref_counts[b], origins.get(i, "")
                mark = KINDS[origin].color if origin else ""
                title = (f"logical {i} → physical block {b} · {held}/{bs} tokens · {part}"
                         + (f" · shared by {ref}" if ref > 1 else "")
                         + {"prefix_hit": " · from the prefix cache", "cow": " · copied on write"}.get(origin, ""))
                label = f"{b}" + (f"<sup>×{ref}</sup>" if ref > 1 else "")
                cls = ("shared " if ref > 1 else "") + ("lit" if b in highlight else "")
                chips.append(_chip(color, label, i, held / bs, prompt, title, cls, mark))
            else:
                chips.append(_chip(color, f"H{b}", i, 0, prompt, f"logical {i} → host block {b} · "
                                   f"{held}/{bs} tokens, swapped out", "host"))
        if len(table or host) > max_chips:
            chips.append(f'<span class="more">+{len(table or host) - max_chips} more</span>')
        where = (f"{len(table)} blocks" if table else f"{len(host)} host blocks" if host else "no blocks")
        text = escape(s.text[-600:]) + ("▌" if s.status == "running" and view.live else "")
        rows.append(
            f'<div class="seq" style="--c:{color}"><div class="top"><span class="id">{escape(s.seq_id)}</span>'
            f'<span class="st {s.status}">{s.status}</span><span class="meta">{s.num_tokens} tokens = '
            f'{min(s.prompt_tokens, s.num_tokens)} prompt + {max(0, s.num_tokens - s.prompt_tokens)} output '
            f'(max {s.max_tokens}) · {where}</span></div>'
            f'<div class="chips">{"".join(chips)}</div><div class="txt"><span>{text}</span></div></div>')
    if len(seqs) > max_seqs:
        rows.append(f'<div class="more">+{len(seqs) - max_seqs} more sequences</div>')
    return CSS + f'<div class="bt">{KEY}{"".join(rows)}</div>'


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

