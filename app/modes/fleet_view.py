"""The fleet page: one small pool overview per engine with its numbers (sorted and filtered as
the user likes; an engine out of free blocks, preempting, down or silent stands out), the prefix
cache across the fleet by content, a prompt scored per engine as a prefix-aware router would,
and in the sidebar the engines (add, remove, find a server's ranks) and a load generator.

`make run ARGS="--fleet fleet.toml"` opens it; "Open an engine" switches the dashboard's
source to that engine (its grid, tables, history, time travel) and "Back to the fleet" returns.
"""
from __future__ import annotations

import base64
import html
import io
import itertools
import time
from dataclasses import dataclass

import numpy as np
import streamlit as st

from kvscope_contract.state import CACHED, FREE, RESERVED, SHARED, USED
from app.fleet import load as fleet_load
from app.ui import roles, stale
from app.panels import prefix_tree
from app.fleet.engines import (ENDPOINT_KINDS, EngineRow, Endpoint, Fleet, FleetFileError, kv_event_sources,
                                    load_fleet, tokenize)
from app.fleet.index import FleetIndex, pick, why, why_words
from app.link.client import NotConnected
from app.fleet.refreshed import Refreshed
from app.derived.words import plural
from app.ui.palette import SEQ_COLORS
from app.ui.palette import SHARED as SHARED_COLOR
from app.link.source import Source
from app.modes import fleet_lesson_view

REDRAW_S = 0.3          # the engines' cards: 3.3 a second, so that late ones still leave 2
INDEX_REDRAW_S = 2.0    # the fleet-wide prefix cache, at least this far apart (and 3x its merge time)
OVERVIEW_CELLS = 1024   # cells of an engine's overview: a cell is the mean colour of its blocks
OVERVIEW_COLS = 64
COLUMNS = 4
STATE_RGB = {FREE: (0xe2, 0xe8, 0xf0), CACHED: (0x94, 0xa3, 0xb8), USED: (0x4e, 0x79, 0xa7),
             SHARED: (0x31, 0x2e, 0x81), RESERVED: (0x33, 0x41, 0x55)}
SORTS = {"name": lambda r: r.name, "standing out": lambda r: (r.alarm == "", r.name),
         "used blocks": lambda r: r.used / max(r.blocks, 1),
         "free blocks": lambda r: r.free / max(r.blocks, 1), "cached blocks": lambda r: r.cached,
         "prefix hit rate": lambda r: r.hit_rate or 0.0, "preemptions": lambda r: r.preemptions or 0,
         "running": lambda r: r.running or 0, "waiting": lambda r: r.waiting or 0,
         "tokens/s": lambda r: r.tokens_per_s or 0.0, "last event age": lambda r: r.last_event_age_s or 0.0,
         "stream gaps": lambda r: r.gaps}
_runs = itertools.count(1)


@st.cache_resource(show_spinner=False, max_entries=4, on_release=Fleet.close)
def fleet_of(path: str) -> Fleet:
    """The fleet of a fleet file (""; an empty one, filled from the sidebar), shared by every session."""
    return Fleet.of(load_fleet(path) if path else [])


# ------------------------------------------------------------------------------ drawing
def overview_png(states: np.ndarray) -> str:
    """A small picture of the pool, blocks in order, as a data URL: each pixel the mean colour of
    its blocks (a density heat where there are more blocks than pixels). Counts each state per
    cell (one bincount) rather than averaging colours per block: a 32,768-block pool in ~0.3 ms."""
    n = len(states)
    per = -(-n // OVERVIEW_CELLS) if n > OVERVIEW_CELLS else 1
    cells = -(-n // per)
    kinds = len(STATE_RGB) + 1  # the states, and white for the last cell's padding
    padded = np.full(cells * per, kinds - 1, np.intp)
    padded[:n] = states
    padded += (np.arange(cells * per) // per) * kinds  # each cell its own range of bins
    counts = np.bincount(padded, minlength=cells * kinds).reshape(cells, kinds)
    lut = np.array([STATE_RGB[s] for s in range(kinds - 1)] + [(255, 255, 255)], np.float64)
    mean = counts @ lut / per
    cols = min(OVERVIEW_COLS, cells)
    rows = -(-cells // cols)
    img = np.full((rows * cols, 3), 255, np.uint8)
    img[:cells] = mean.astype(np.uint8)
    from PIL import Image  # Streamlit's own dependency
    buf = io.BytesIO()
    Image.fromarray(img.reshape(rows, cols, 3)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _n(x, fmt: str = "{:,}") -> str:
    return "–" if x is None else fmt.format(x)


CSS = """<style>
.fc { font: 12px/1.45 var(--st-font, system-ui, sans-serif); }
.fc .hd { display: flex; justify-content: space-between; gap: 6px; font-weight: 700; font-size: 14px; }
.fc .st { font-weight: 600; font-size: 11px; padding: 0 6px; border-radius: 8px; color: #fff; background: #16a34a; }
.fc .st.down, .fc .st.silent, .fc .st.stalled { background: #dc2626; } .fc .st.connecting { background: #64748b; }
.fc .alarm { color: #dc2626; font-weight: 700; }
.fc img { width: 100%; image-rendering: pixelated; border-radius: 3px; margin: 4px 0; min-height: 12px; }
.fc .nums { display: grid; grid-template-columns: 1fr 1fr; column-gap: 8px; }
.fc .nums b { font-variant-numeric: tabular-nums; }
.fc .err { color: #b91c1c; font-size: 11px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.fleet-grid { display: grid; grid-template-columns: repeat({COLUMNS}, minmax(0, 1fr)); gap: 12px; }
.fleet-grid .fc { border: 1px solid rgba(49, 51, 63, .2); border-radius: 8px; padding: 10px 12px; min-width: 0; }
.fc.out { box-shadow: inset 4px 0 0 #dc2626; padding-left: 14px; }
.fc.gone .body { opacity: .4; filter: grayscale(1); }
.fc .seen { color: #64748b; font-size: 11px; font-style: italic; }
.fc .api { opacity: .7; font-size: 11px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
</style>""".replace("{COLUMNS}", str(COLUMNS))


HIT_RATES = {  # the card's two hit rates: label, what it counts (the single-engine header's definitions)
    "hit_rate": ("hit rate, KVScope's", "prefix-cache hit tokens over tokens looked up at every admission, "
                 "re-admissions after a preemption included, since this page attached or the engine's last "
                 "reset, whichever came later"),
    "first_hit_rate": ("hit rate, vLLM's", "the same at each request's first admission only: vLLM's own "
                       "prefix_cache_hits / prefix_cache_queries over these requests"),
}


def card(row: EngineRow, picture: str | None, drawn: int = 0) -> str:
    """`drawn`: the page's redraw number (data-drawn: what a test or bench counts redraws by).
    A down engine's card is greyed: its numbers are the last seen, and the fleet's totals leave it out."""
    pct = (lambda x: f"{100 * x / row.blocks:.0f}%") if row.blocks else (lambda x: "")
    rates = ["hit_rate", "first_hit_rate"] if row.kind == "vllm-plugin" else ["hit_rate"]
    nums = [("used", f"{row.used:,} {pct(row.used)}" if row.blocks else "–", ""),
            ("cached", f"{row.cached:,} {pct(row.cached)}", ""),
            ("free", f"{row.free:,} {pct(row.free)}" if row.blocks else "–", ""),
            *((HIT_RATES[k][0], _n(getattr(row, k), "{:.0%}"), HIT_RATES[k][1]) for k in rates),
            ("preemptions", _n(row.preemptions), ""),
            ("running / waiting", f"{_n(row.running)} / {_n(row.waiting)}", ""),
            ("tokens/s", _n(row.tokens_per_s, "{:.1f}"), "over the engine steps of the last few seconds"),
            ("last event", _n(row.last_event_age_s, "{:.1f} s ago"), ""), ("stream gaps",
             f"{row.gaps:,}" + (f" · {row.skipped:,} events skipped" if row.skipped else ""),
             "snapshots that took the place of events this page fell behind on (or lost with its connection): "
             "the pool is exact, and KVScope's engines send the counts the skipped events made")]
    body = "".join(f'<span title="{html.escape(tip)}">{k}</span><b>{html.escape(v)}</b>' for k, v, tip in nums)
    img = (f'<img src="{picture}" title="{row.blocks:,} blocks: used (blue), shared (indigo), cached (grey), free '
           f'(light)">'
           if picture else '<div class="err">no pool: a KV-event stream says only what is cached</div>'
           if row.kind == "kv-events" else "")
    alarm = f'<div class="alarm">⚠ {html.escape(row.alarm)}</div>' if row.alarm else ""
    err = f'<div class="err" title="{html.escape(row.error)}">{html.escape(row.error)}</div>' if row.error else ""
    seen = (f'<div class="seen">last seen {row.seen_s_ago:.0f} s ago: not in the fleet\'s totals</div>'
            if row.seen_s_ago is not None and row.blocks else "")
    api = f'<div class="api">OpenAI API {html.escape(row.api)}/v1</div>' if row.api else ""
    gone = " gone" if row.seen_s_ago is not None else ""
    return (f'<div class="fc{" out" if row.alarm else ""}{gone}" data-engine="{html.escape(row.name)}" '
            f'data-drawn="{drawn}">'
            f'<div class="hd"><span>{html.escape(row.name)}</span><span class="st {row.state}">{row.state}</span></div>'
            f'<div style="opacity:.7">{html.escape(row.kind)} · {html.escape(row.url)}</div>{api}{alarm}{seen}'
            f'<div class="body">{img}<div class="nums">{body}</div></div>{err}</div>')


def engine_color(names: list[str], held: set[str]) -> str:
    if len(held) > 1:
        return SHARED_COLOR
    name = next(iter(held), "")
    return SEQ_COLORS[names.index(name) % len(SEQ_COLORS)] if name in names else "#64748b"


# ------------------------------------------------------------------------------ the page
def page(source: Source) -> None:
    st.title("KVScope · Fleet")
    try:
        fleet = fleet_of(source.path)
    except FleetFileError as e:
        st.error(f"{e}")
        return
    if roles.may_drive():  # a shared dashboard's viewers see the cards, nothing that drives or names a server
        with st.sidebar:
            engines_panel(fleet)
            load_panel(fleet)
        st.fragment(fleet_lesson_view.panel, run_every=fleet_lesson_view.REDRAW_S)(fleet, source)
    c = st.columns([2, 1, 2, 1])
    c[0].selectbox("Sort by", list(SORTS), key="fleet_sort")
    c[1].toggle("Descending", False, key="fleet_desc")
    c[2].text_input("Filter by name", key="fleet_filter", placeholder="all engines")
    c[3].toggle("Only those standing out", False, key="fleet_alarms",
                help="down, stalled, silent, out of free blocks, or preempting")
    names = [e.name for e in fleet.members()]
    o = st.columns([5, 1], vertical_alignment="bottom")
    chosen = o[0].selectbox("Open an engine", names, index=None, key="fleet_open_pick", placeholder="choose an engine",
                           help="Show it in the single-engine views: grid, tables, history, time travel")
    # buttons outside the fragments act in their callbacks: a click can reach the server with a
    # fragment's timed rerun (that fragment's run then runs the callback); `cards` redraws the page
    o[1].button("Open", key="fleet_open", width="stretch", disabled=chosen is None, on_click=_open,
                args=(fleet, source))
    st.fragment(cards, run_every=REDRAW_S)(fleet, source)
    st.fragment(prefix_cache, run_every=INDEX_REDRAW_S)(fleet, source.path)


def cards(fleet: Fleet, source: Source) -> None:
    if st.session_state.get("source", source) != source:
        st.rerun()  # the source changed under this fragment (a Connect click can ride its rerun)
    stale.redraw_if_stale()
    members = {e.name: e for e in fleet.members()}
    if not members:  # here, not above: the lesson adds engines while only the fragments redraw
        st.info("No engine yet: add one in the sidebar (a KVScope engine, a vLLM with the KVScope plugin, "
                "or a KV-event stream), or start with `make run ARGS=\"--fleet fleet.toml\"`; or start the "
                "routing lesson above, which starts two KVScope engines of its own.")
    rows = [r for r in fleet.rows() if r.name in members]  # one removed meanwhile: gone
    st.session_state["fleet_rows"] = rows
    drawn = st.session_state["fleet_drawn"] = st.session_state.get("fleet_drawn", 0) + 1
    live = sum(r.state == "live" for r in rows)
    sort = st.session_state.get("fleet_sort") or "name"
    rows = sorted(rows, key=SORTS[sort], reverse=bool(st.session_state.get("fleet_desc")))
    text = (st.session_state.get("fleet_filter") or "").strip().lower()
    rows = [r for r in rows if text in r.name.lower() and (r.alarm or not st.session_state.get("fleet_alarms"))]
    st.caption(f"{plural(len(members), 'engine')} · {live} live · shown: {len(rows)} · redrawn every {REDRAW_S:g} s")
    # one element for every card: a fleet of 64 as ~200 Streamlit elements (columns, containers,
    # buttons) redrew 0.3 times a second on 2 loaded cores, as one grid about 2 (docs/benchmarks.md)
    cells = "".join(card(row, members[row.name].picture(overview_png), drawn) for row in rows)
    st.html(CSS + f'<div class="fleet-grid">{cells}</div>')


@dataclass(frozen=True)
class PrefixCacheView:
    """The fleet-wide prefix cache at one moment, with everything the page shows of it."""
    ix: FleetIndex
    numbers: list[tuple[str, str, str]]  # (label, value, help) of the metrics
    identity: str
    disagree: bool
    names: list[str]
    forest_html: str
    left_out: str  # the engines down, whose last seen caches these numbers leave out ("" if none)
    cached: dict[str, int]  # each live engine's cached blocks when this was merged (the cards say them now)


def prefix_cache_view(fleet: Fleet) -> PrefixCacheView:
    """Merge, count and draw (seconds at 64 engines: run by `Refreshed`, off the page's thread)."""
    rows = fleet.rows()
    ix = fleet.index(rows)
    names = [e.name for e in fleet.members()]
    gone = [r for r in rows if r.seen_s_ago is not None and r.cached]
    left_out = "; ".join(f"{r.name} is {r.state}: its {plural(r.cached, 'cached block')}, last seen "
                         f"{r.seen_s_ago:.0f} s ago, are left out" for r in gone)
    numbers = [("cached contents", f"{len(ix.holders):,}", "distinct cached blocks, by content"),
               ("physical blocks", f"{sum(ix.copies(c) for c in ix.holders):,}",
                "cached blocks in every engine's pool"),
               ("duplicated blocks", f"{ix.duplicated_blocks():,}",
                "every copy but one of content the fleet holds more than once"),
               ("duplicated", f"{ix.duplicated_bytes() / 2**20:,.1f} MiB",
                "those blocks' bytes, at each engine's bytes per block"),
               ("on 2+ engines", f"{sum(n for k, n in ix.shared_by().items() if k > 1):,}",
                "contents cached by more than one engine")]
    holders = ix.holders
    forest = prefix_tree.render(ix.forest(), max_nodes=300, text=lambda n: ",".join(sorted(holders.get(n.key, {}))),
                                color=lambda n: engine_color(names, set(holders.get(n.key, {}))))
    return PrefixCacheView(ix, numbers, ix.identity(), bool(ix.hash_disagreements()), names, forest, left_out,
                           {r.name: r.cached for r in rows if r.seen_s_ago is None})


def behind(v: PrefixCacheView, rows: list[EngineRow], age_s: float) -> str:
    """What the merged view says, if the engines' caches moved since it was merged: their cards' cached
    blocks now against the view's ("" when they agree)."""
    now = {r.name: r.cached for r in rows if r.seen_s_ago is None}
    if now == v.cached:
        return ""
    return (f"As of {age_s:.0f} s ago: the engines' caches have changed since (their cards now say "
            f"{sum(now.values()):,} cached blocks, merged here {sum(v.cached.values()):,}); merging again.")


@st.cache_resource(show_spinner=False, max_entries=4)
def prefix_cache_of(path: str) -> Refreshed[PrefixCacheView]:
    """The fleet's prefix cache, kept fresh in the background and shared by every session."""
    fleet = fleet_of(path)
    return Refreshed(lambda: prefix_cache_view(fleet), INDEX_REDRAW_S)


def prefix_cache(fleet: Fleet, path: str) -> None:
    st.subheader("The prefix cache across the fleet")
    shared = prefix_cache_of(path)
    fresh = shared.get(wait_s=5)
    if fresh is None:
        st.caption("Merging the engines' prefix caches…"
                   + (f" (the last try failed: {shared.error})" if shared.error else ""))
        return
    v = fresh.value
    if note := behind(v, st.session_state.get("fleet_rows") or fleet.rows(), max(0.0, time.time() - fresh.at)):
        st.warning(note, icon=":material/update:")  # never the past told as now
    for col, (label, value, help_) in zip(st.columns(len(v.numbers)), v.numbers):
        col.metric(label, value, help=help_)
    if v.left_out:
        st.caption(f":gray[{v.left_out}: these numbers count the engines that are up.]")
    (st.warning if v.disagree else st.caption)(v.identity)
    left, right = st.columns([3, 2])
    with left:
        swatch = '<span style="display:inline-block;width:10px;height:10px;background:{}"></span> {}'.format
        key = " ".join(swatch(engine_color(v.names, {n}), html.escape(n)) for n in v.names) + " " + swatch(
            SHARED_COLOR, "several")
        st.caption("The merged prefix forest: each cached content once, coloured by the engine holding it "
                   "(indigo: several, named on the block; ×n copies: the physical blocks holding it). "
                   f"As of {max(0.0, time.time() - fresh.at):.0f} s ago; "
                   f"merging took {fresh.took_s:.1f} s, so it is merged again every "
                   f"{max(INDEX_REDRAW_S, shared.spacing * fresh.took_s):.0f} s.")
        st.html(f'<div style="font-size:12px">{key}</div>')
        st.html(v.forest_html)
    with right:
        route_panel(fleet, v.ix, st.session_state.get("fleet_rows") or fleet.rows())


SCORE_AS = {"chat": "a chat", "plain": "a plain prompt"}


def route_panel(fleet: Fleet, ix: FleetIndex, rows: list[EngineRow]) -> None:
    st.markdown("**Type a prompt**: how much of it each engine has cached")
    how = st.segmented_control("Score it as", list(SCORE_AS), format_func=SCORE_AS.get, default="chat",
                               key="fleet_prompt_as", help="A chat: as the load generator sends it (the text as "
                               "the system prompt, then the question, in each engine's chat template). A plain "
                               "prompt: the text as a completion request sends it.") or "chat"
    chat = how == "chat"
    text = st.text_area("System prompt" if chat else "Prompt", key="fleet_prompt", height=90,
                        placeholder="a system prompt: the chat template wraps it, then the question, as a chat "
                        "request's tokens are" if chat else "a prompt, as a completion request would send it")
    question = st.text_input("Question", fleet_load.QUESTIONS[0], key="fleet_prompt_question") if chat else ""
    if not text.strip():
        return
    messages = fleet_load.ChatRequest(text, question, "").messages() if chat else None
    free = {r.name: r.free + r.cached for r in rows}
    memo = st.session_state.setdefault("fleet_tokens", {})  # (engine, how, prompt) -> its token ids: asked once
    out, scores = [], []
    for eng in fleet.members():
        key = (eng.name, how, text, question)
        ids = memo.get(key)
        if ids is None and (ids := tokenize(eng, text, messages=messages)) is not None:
            memo[key] = ids
        s = next((x for x in ix.score(ids) if x.engine == eng.name), None) if ids is not None else None
        scores += [s] if s else []
        w = why(ix, eng.name, ids) if ids is not None else None
        out.append({"engine": eng.name, "prompt tokens": len(ids) if ids is not None else None,
                    "cached tokens": s.cached_tokens if s else None, "blocks": s.blocks if s else None,
                    "would reuse": s.reusable_tokens if s else None, "why not more": why_words(w) if w else None})
    if best := pick(scores, free):
        o = next(o for o in out if o["engine"] == best)
        st.success(f"A prefix-aware router picks **{best}** ({o['cached tokens']:,} of {o['prompt tokens']:,} "
                   "tokens cached; a tie goes to the engine with the most free and cached blocks).")
    st.dataframe(out, hide_index=True, width="stretch")
    st.caption("Cached tokens: the prompt's longest prefix in full blocks this engine holds, at its block size, as "
               "a prefix-aware router scores it. Would reuse: what the engine then takes from its cache (vLLM's "
               "`cached_tokens`): the engine always computes a prompt's last token, so a prompt that fills its "
               "last block exactly reuses one block less. A chat is scored in the tokens its template gives it "
               "(its roles' markers first): a system prompt pasted as a plain prompt matches nothing a chat "
               "cached. An engine whose tokenizer cannot be asked (a KV-event stream without `api`) shows –. "
               "Why not more: the rest of the prompt's tokens on that engine, evicted (it had cached them; when), "
               "on another engine (named), on no engine, in a sliding window's lost run, or in the partial "
               "block its last token is in (docs/misses.md).")


# ------------------------------------------------------------------------------ sidebar
def engines_panel(fleet: Fleet) -> None:
    with st.expander("Engines", expanded=not fleet.members()):
        with st.form("fleet_add", border=False):
            name = st.text_input("Name", key="fleet_add_name")
            url = st.text_input("URL", key="fleet_add_url", placeholder="ws://127.0.0.1:8765 or tcp://HOST:5557")
            kind = st.selectbox("Kind", ENDPOINT_KINDS, key="fleet_add_kind")
            api = st.text_input("OpenAI server (optional)", key="fleet_add_api", placeholder="http://127.0.0.1:8000",
                                help="vLLM's server: prompts are tokenized there; with kv-events, its ranks are looked "
                                     "up")
            rank = st.number_input("Data-parallel rank", 0, 1024, 0, key="fleet_add_rank",
                                   help="vllm-plugin: rank r serves on the plugin's port + r")
            if st.form_submit_button("Add engine", width="stretch"):
                try:
                    fleet.add(Endpoint(name.strip() or f"engine-{len(fleet.members()) + 1}", url.strip(), kind,
                                       api.strip(), int(rank) or None).check())
                except ValueError as e:
                    st.error(str(e))
        names = [e.name for e in fleet.members()]
        if names:
            c = st.columns([3, 2])
            c[0].selectbox("Engine", names, key="fleet_remove_pick", label_visibility="collapsed")
            c[1].button("Remove", width="stretch", key="fleet_remove",
                        on_click=lambda: fleet.remove(st.session_state["fleet_remove_pick"]))
        api = st.text_input("Find a server's ranks", key="fleet_find", placeholder="http://HOST:8000",
                            help="asks the server's GET /kv_event_sources and adds a KV-event endpoint per rank")
        st.button("Find ranks", key="fleet_find_go", disabled=not api.strip(), on_click=_find_ranks, args=(fleet,))
        for level, msg in st.session_state.pop(FIND_NOTES, []):
            getattr(st, level)(msg)


FIND_NOTES = "fleet_find_notes"  # session state: what the last Find ranks said, as (level, text)


def _find_ranks(fleet: Fleet) -> None:
    api = st.session_state["fleet_find"].strip()
    found = kv_event_sources(api)
    notes = [] if found is not None else [("error", f"{api} does not answer GET /kv_event_sources (a server without "
                                                    "that route): add each rank's endpoint by hand")]
    for e in found or []:
        try:
            fleet.add(e)
        except ValueError as err:
            notes.append(("warning", str(err)))
    st.session_state[FIND_NOTES] = notes


def load_panel(fleet: Fleet) -> None:
    with st.expander("Load generator", expanded=True):
        st.caption("A chat workload with shared system prompts, sent to the engines that take prompts.")
        st.segmented_control("Routing", fleet_load.POLICIES, default="round-robin", key="fleet_policy")
        c = st.columns(2)
        c[0].number_input("Requests", 1, 256, 12, key="fleet_n")
        c[1].number_input("System prompts", 1, len(fleet_load.SYSTEM_PROMPTS), 3, key="fleet_systems")
        st.number_input("Max tokens", 1, 512, 16, key="fleet_max_tokens")
        st.button("Send", type="primary", width="stretch", key="fleet_send", on_click=_send, args=(fleet,))
        if msg := st.session_state.get("fleet_sent"):
            st.caption(msg)
        st.fragment(load_since, run_every=1.0)(fleet)
        st.button("Clear every prefix cache", width="stretch", key="fleet_clear",
                  help="on the engines that allow it (vLLM: only with VLLM_SERVER_DEV_MODE=1)",
                  on_click=_clear_all, args=(fleet,))


def _send(fleet: Fleet) -> None:
    """Send's callback; the form's values by key (a value changed with the click comes with it)."""
    values = st.session_state
    policy = values.get("fleet_policy") or "round-robin"
    n, systems = int(values["fleet_n"]), int(values["fleet_systems"])
    max_tokens = int(values["fleet_max_tokens"])
    targets = takers(fleet)  # asked at the click: the sidebar is not redrawn on the cards' timer
    plan = fleet_load.assign(fleet_load.workload(n, systems, f"{policy[:2]}{next(_runs)}"), [e.name for e in targets],
                             policy)
    st.session_state["fleet_load_base"] = {e.name: e.lookups() for e in targets}
    st.session_state["fleet_failed_base"] = {e.name: e.load_failed for e in fleet.members()}
    failed = fleet_load.send_all(plan, lambda name, cmd: fleet.engines[name].submit(cmd), max_tokens)
    st.session_state["fleet_sent"] = (
        f"sent {len(plan) - len(failed)} of {plural(len(plan), 'request')} {policy} to {plural(len(targets), 'engine')}"
        + (f"; {len(failed)} could not be sent: " + "; ".join(failed.values()) if failed else "")
        if targets else "no live engine takes prompts")


def _clear_all(fleet: Fleet) -> None:
    """Clear's callback: ask every engine; `load_since` then says what each answered."""
    asked = []
    for e in fleet.members():
        try:
            e.clear_prefix_cache()
        except NotConnected:
            pass  # said as "not asked"
        asked.append(e.name)
    st.session_state["fleet_cleared"] = asked


def load_since(fleet: Fleet) -> None:
    """Each engine's prefix hit rate over the requests since the last Send (a card's hit rate counts
    everything since the page attached, both policies' runs together)."""
    base = st.session_state.get("fleet_load_base") or {}
    parts = []
    for name, before in base.items():
        eng = fleet.engines.get(name)
        now = eng.lookups() if eng is not None else None
        if before is not None and now is not None and now[1] > before[1]:
            hit, looked = now[0] - before[0], now[1] - before[1]
            parts.append(f"{name} **{hit / looked:.0%}** ({hit:,} of {looked:,} tokens)")
    if parts:
        st.caption("Hit rate since this Send: " + " · ".join(parts))
    if asked := st.session_state.get("fleet_cleared"):
        said = [f"{n} {fleet.engines[n].cleared()}" for n in asked if n in fleet.engines]
        st.caption("Clear every prefix cache: " + " · ".join(said))
    # sends fail later too: a refusal, no answer before a connection closed, an HTTP error
    failed_base = st.session_state.get("fleet_failed_base") or {}
    for e in fleet.members():
        if n := e.load_failed - failed_base.get(e.name, 0):
            st.caption(f":red[{e.name}: {plural(n, 'request')} failed since this Send; the last: {e.load_errors[-1]}]")


def takers(fleet: Fleet) -> list:
    """The engines that take prompts now (see FleetEngine.takes_prompts)."""
    return [e for e in fleet.members() if e.takes_prompts()]


# ------------------------------------------------------------------------------ leaving and coming back
def _open(fleet: Fleet, source: Source) -> None:
    if (chosen := st.session_state.get("fleet_open_pick")) in fleet.engines:
        open_engine(fleet.engines[chosen].endpoint, source)


def open_engine(endpoint: Endpoint, fleet_source: Source) -> None:
    """Show one engine in the single-engine views; the sidebar offers the way back."""
    st.session_state["fleet_back"] = fleet_source
    st.session_state["source"] = (Source("kv_events", url=endpoint.address) if endpoint.kind == "kv-events"
                                  else Source("attach", url=endpoint.address, token=endpoint.token))
    st.session_state["travel"] = None


def back_button() -> None:
    """In the sidebar of the single-engine views, after "Open" on the fleet page."""
    back = st.session_state.get("fleet_back")
    if back is not None and st.session_state.get("source") != back:
        st.button("Back to the fleet", icon=":material/arrow_back:", width="stretch", key="fleet_back_btn",
                  on_click=lambda: st.session_state.update({"source": back, "travel": None}))
