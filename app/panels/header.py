"""The header: connection status, the metrics with warning thresholds, and the teaching
number (what a contiguous max-length reservation would hold next to what paging holds). Each
is data or HTML for the live views' one element (app/panels/grid.py, assets/live.js), drawn
from one Redraw."""
from __future__ import annotations

from html import escape

from kvscope_contract import protocol as p
from app.link.client import Redraw, Status, View
from app.ui.connection import Hosted
from app.ui.icons import icon
from app.history.mirror import RATE_STEPS, Tally
from app.ui.palette import RESERVED_BAR, USED
from app.history.groups import span
from app.derived.words import count, plural, rate
from app.link.source import Source

CONNECTION_COLORS = {"connected": "green", "connecting": "orange", "reconnecting": "orange", "failed": "red",
                     "closed": "red"}
# Metric thresholds: the colour turns at these values (and the help texts say so).
POOL_ORANGE, POOL_RED = 0.80, 0.95
SLOT_UTIL_ORANGE = 0.50
HOST_ORANGE = 0.80
VLLM_HIT_RATE = ("vLLM's own prefix_cache_hits / prefix_cache_queries (its /metrics), from the same events: "
                 "tokens found in the cache over the tokens looked up at each request's first admission. "
                 "vLLM counts a request admitted again after a recompute preemption apart (as a preempted "
                 "query), and those re-admissions find their own blocks still cached: KVScope's rate above "
                 "counts every admission, so under preemption it is the higher one.")


RESYNC_HELP = ("This dashboard fell behind the engine (or lost its connection), and a snapshot of the pool took the "
               "place of the events it had not read yet. The pool is exact; the counters include what the skipped "
               "events counted where the engine says (KVScope's engine and replays do); the timeline and the event "
               "log have a gap there.")


def status(conn: Status, hello: p.Hello | None, loop: p.LoopState, url: str, source: Source, died: bool,
           addresses: bool = True) -> str:
    """The status line, as HTML: the connection, what the source is, and the engine loop's state;
    `addresses`: the engine's and its OpenAI server's (not to a shared dashboard's viewers)."""
    what = escape(source.label)
    if hello:
        e = hello.engine
        kern = ((f", {e.gemv_dtype} GEMV weights" if e.gemv_dtype else "")
                + (f", {e.kernels} kernels" if e.kernels else ""))
        what += escape(f" · {e.model} on {e.device} ({e.dtype}{kern})" + (" · replay" if hello.replay else ""))
        if hello.server != "kvscope":
            what += escape(f" · {hello.server}")
    state = "died" if died else conn.state
    text = f'<span class="t-{CONNECTION_COLORS.get(state, "red")}">● <b>{state.capitalize()}</b></span> · {what}'
    if addresses:
        text += f" · <code>{escape(url)}</code>"
    if addresses and hello and hello.api_url:  # where its prompts go: vLLM's OpenAI server, for curl and other clients
        text += f" · OpenAI API <code>{escape(hello.api_url)}/v1</code>"
    if state not in ("connected", "died"):
        text += ((f" · attempt {conn.attempts}" if state == "reconnecting" else "")
                 + (f" · {escape(conn.last_error)}" if conn.last_error else ""))
    if resynced := conn.resynced():  # events that gave way to a snapshot: the counters say what they counted
        text += f' · <span title="{escape(RESYNC_HELP)}">{escape(resynced)}</span>'
    if state != "connected":
        text += " · the views show the last state received"
    elif loop.paused:
        text += (f' · <span class="t-orange">{icon("pause_circle")}<b>paused</b></span> '
                 "(Step, Run to the next key event or Resume in the sidebar)")
    elif loop.until:
        text += f' · <span class="t-blue">{icon("fast_forward")}<b>running to the next key event</b></span>'
    elif loop.step_delay_ms:
        text += f" · pace {loop.step_delay_ms:g} ms per step"
    return text


def status_of(r: Redraw, source: Source, hosted: Hosted | None, addresses: bool = True) -> str:
    return status(r.status, r.hello, r.loop, r.url, source, hosted is not None and hosted.process.died, addresses)


def usage(view: View) -> dict[str, float]:
    """The view's usage numbers, computed once per view (every session shares them)."""
    if "usage" not in view.memo:
        view.memo["usage"] = view.mirror.usage(view.block_states())
    return view.memo["usage"]


def _short(n: int) -> str:
    """A pool size that fits a metric's chip: 65,536, 1.05 M."""
    return f"{n / 1e6:.3g} M" if n >= 1_000_000 else f"{n:,}"


def _of_tokens(part: int, whole: int) -> str:
    """'288 / 474 tokens' where it fits the card's chip (about 16 characters), else the bare counts
    ('9,999 / 9,999', '41.8 k / 180 k'); the tooltip has them exact."""
    full = f"{part:,} / {whole:,} tokens"
    return full if len(full) <= 16 else f"{count(part)} / {count(whole)}"


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB" if b >= 2**20 else f"{b / 2**10:,.0f} KiB"


def metric(label: str, value: str, delta: str, color: str, help: str, note: str = "", note_help: str = "",
           button: tuple[str, str] | None = None) -> dict:
    """One metric card as the live views draw it: `color` is the chip's (Streamlit's names);
    `note`: a line of HTML under it; `button`: (label, help) of a button under it (the element's
    `why` trigger)."""
    return {"label": label, "value": value, "delta": delta, "color": color, "help": help, "note": note,
            "noteHelp": note_help, "button": button}


WHY = ("Why not more?", "Why the prefix cache missed, token by token, and what would have hit: opens the panel "
       "under the grid")


def metrics(r: Redraw, tl: Tally | None = None) -> dict:
    """Two rows of four metrics, each with a colour that turns when a threshold is crossed, and
    the line that says what the counters cover (`tl`: the session's own counters, by default the
    client's)."""
    view = r.view
    m, cfg = view.mirror, view.mirror.config
    tl = tl or m.tally
    u = usage(view)
    pool = u["used"] / u["total"] if u["total"] else 0.0
    host = u["host_used"] / u["host_total"] if u["host_total"] else 0.0
    util, last = u["slot_util"], tl.last_step
    run, wait, swap = (sum(s.status == k for s in m.state.seqs.values()) for k in ("running", "waiting", "swapped"))
    caching = cfg.enable_prefix_caching
    vllm = caching and r.hello is not None and r.hello.server.startswith("vllm")
    cards = [
        metric("Pool usage", f"{pool:.0%}", f"{u['used']:,} / {_short(u['total'])}",
               "red" if pool >= POOL_RED else "orange" if pool >= POOL_ORANGE else "gray",
               "Device blocks held by at least one sequence. Cached blocks (no holder, still "
               f"hit-able) are not counted: an allocation may evict them. Orange from {POOL_ORANGE:.0%}, "
               f"red from {POOL_RED:.0%}."),
        metric("Slot utilisation", f"{util:.0%}" if u["used"] else "–",
               f"{u['waste_per_seq']:.1f} empty / seq" if u["used"] else "no block in use",
               "orange" if util < SLOT_UTIL_ORANGE and u["used"] else "green",
               "Tokens stored over the slots of used blocks: internal fragmentation. Only the last "
               f"block of a sequence is partly empty, about {cfg.block_size / 2:g} slots each. "
               f"Orange under {SLOT_UTIL_ORANGE:.0%}."),
        metric("Prefix hit rate", f"{tl.hit_rate:.0%}" if caching else "off",
               _of_tokens(tl.hit_tokens, tl.looked_up_tokens) if caching else "caching off", "blue",
               "Tokens found in the prefix cache over the tokens looked up there, at every "
               "admission of a sequence (a re-admission after a recompute preemption looks its tokens up again), "
               f"since {tl.since}: {tl.hit_tokens:,} / {tl.looked_up_tokens:,}. Found tokens are not computed again.",
               note=(f"vLLM's definition: <b>{tl.first_hit_rate:.0%}</b> · {tl.first_hit_tokens:,} / "
                     f"{tl.first_looked_up_tokens:,} tokens" if vllm else ""),
               note_help=VLLM_HIT_RATE if vllm else "", button=WHY),
        metric("Tokens/s", rate(tl.tokens_per_s()),
               f"avg of {plural(len(tl.steps), 'step')}" if last else "no step yet",
               "gray",
               f"Tokens generated per second of the engine's own step time (the steps' durations, "
               f"pauses and pace not counted), over the last {RATE_STEPS} steps (those since a reset, when "
               f"fewer) up to this event: {tl.tokens_per_s():,.1f} ({tl.generated:,} tokens in all). A prefill "
               "step computes a whole prompt for its one token, so the rate falls when prompts arrive."
               + (f" The last step took {last.duration_ms:,.0f} ms." if last else "")),
        metric("Copy-on-write", f"{tl.cows:,}", f"copies · {tl.forks:,} forks", "violet" if tl.cows else "gray",
               "Blocks copied because a sequence wrote into a block it shared (parallel samples): one "
               f"copy each (the grid outlines both the original and the copy). Since {tl.since}."),
        metric("Swaps out / in", f"{tl.swap_outs:,} / {tl.swap_ins:,}",
               f"host {u['host_used']:,} / {u['host_total']:,}",
               "orange" if host >= HOST_ORANGE else "violet" if tl.swap_outs else "gray",
               "Sequences moved to the host pool and back. Frequent swapping means the pool is too "
               f"small. Orange when the host pool is {HOST_ORANGE:.0%} full. Since {tl.since}."),
        metric("Preemptions", f"{tl.preemptions:,}", f"{tl.recomputes:,} recomputed",
               "red" if tl.preemptions else "gray",
               f"Sequences stopped because the pool ran out of blocks (swapped out or recomputed). Since {tl.since}."),
        metric("Running", f"{run:,}", f"{wait:,} wait" + (f" · {swap:,} swap" if swap else ""),
               "orange" if wait or swap else "gray",
               f"Live sequences: running, waiting for blocks, swapped out to the host pool. At most "
               f"{cfg.max_num_seqs:,} run at once; {tl.finished:,} have finished."),
    ]
    since = "" if tl.since == "engine start" else (  # counters cover only what this client saw
        f"Counters since {escape(tl.since)}; pool usage and sequences are the whole engine's.")
    return {"cards": cards, "since": since, "groups": groups_line(u, cfg) if u["kinds"] else "",
            "groupsHelp": GROUPS_HELP}


GROUPS_HELP = ("A hybrid model's layers make KV-cache groups of one attention kind each; every sequence has a "
               "block table per group, and one pool serves them all (a block of any group holds as many layers). "
               "A sliding-window group frees the blocks its window has passed (still cached if hashed); a "
               "full-attention group keeps every block. Used: blocks some sequence holds in that group's tables; "
               "cached: blocks its prefix cache keeps with no holder; slots: tokens stored over the used blocks' "
               "slots.")


def groups_line(u: dict, cfg) -> str:
    """The pool by kind of KV-cache group (HTML): 'KV-cache groups · sliding 512 ×5 (groups 0–4): 749
    used (150 per group), 93% of slots, 2,700 cached · full (group 5): ...'."""
    parts = []
    for k in u["kinds"]:
        gs = k.groups
        where = f"group {gs[0]}" if len(gs) == 1 else f"groups {span(list(gs))}"
        each = f" ({k.used / len(gs):,.0f} per group)" if len(gs) > 1 else ""
        util = f", {k.slot_util:.0%} of slots hold tokens" if k.used else ""
        parts.append(f"<b>{escape(k.label)}</b> ({where}): {k.used:,} used{each}{util}, {k.cached:,} cached")
    return "KV-cache groups · " + " · ".join(parts)


def reservation_card(view: View) -> str:
    """Teaching point 1: a contiguous max-length reservation per sequence vs paging (HTML)."""
    u, cfg = usage(view), view.mirror.config
    holding = u["holding"]
    res, pag = u["reserved_slots"], u["paged_slots"]
    hybrid = bool(u["kinds"])
    top = max(res, pag, 1)

    def bar(label: str, slots: int, used: float, size: str, color: str) -> str:
        return (f'<div style="margin:6px 0 2px">{label}: <b>{slots:,}</b> slots · {size} · '
                f'<b>{used:.0%}</b> hold tokens</div>'
                f'<div style="background:rgba(148,163,184,.18);border-radius:3px;height:14px">'
                f'<div style="width:{100 * slots / top:.1f}%;height:14px;border-radius:3px;background:'
                f'linear-gradient(to right,{color} {100 * used:.1f}%,color-mix(in srgb,{color} 25%,transparent) '
                f'{100 * used:.1f}%)"></div></div>')

    body = (bar("Contiguous, prompt + max tokens reserved per sequence" + (" and group (a window's: at most W)"
                                                                         if hybrid else ""),
                res, u["reserved_util"], _mib(u["reserved_bytes"]), RESERVED_BAR)
            + bar(f"Paged, blocks held × {cfg.block_size}", pag, u["slot_util"], _mib(u["paged_bytes"]), USED)
            + summary(res, pag, cfg) + (by_group(u, cfg) if hybrid else "")
            if holding else
            '<div style="opacity:.75;margin-top:4px">Appears while sequences hold blocks: a contiguous cache '
            'reserves prompt + max tokens per sequence up front; paging takes one block at a time, on demand.</div>')
    return (f'<div style="font:13px/1.4 var(--st-font,system-ui);padding:10px 12px;border:1px solid '
            f'rgba(148,163,184,.4);border-radius:8px"><b>What paging saves</b> · {plural(holding, "sequence")} holding '
            f'memory · {cfg.bytes_per_block:,} bytes per block of {plural(cfg.block_size, "token")}'
            + (f' (one group\'s {plural(len(cfg.groups[0].layers), "layer")})'
               if hybrid and cfg.groups[0].layers else "")
            + f'{body}{host_tier(view)}</div>')


def host_tier(view: View) -> str:
    """The card's line on a pool with a host tier (docs/offload.md): what the tier holds, and what
    its loads saved computing again, as counted since the client's counters began (HTML)."""
    cfg, mirror = view.mirror.config, view.mirror
    if not cfg.num_offload_blocks:
        return ""
    held, loaded, bpb = int(mirror.state.offload_has.sum()), mirror.tally.host_loaded_blocks, cfg.bytes_per_block
    memory = (f" ({_mib(held * bpb)} of host memory)", f", {_mib(loaded * bpb)} copied") if bpb else ("", "")
    return (f'<div style="margin-top:6px">Host tier: <b>{held:,}</b> of {plural(cfg.num_offload_blocks, "block")} '
            f'hold a stored block{memory[0]}; <b>{plural(loaded, "block")}</b> loaded back instead of computed '
            f'again ({plural(loaded * cfg.block_size, "token")}{memory[1]}, since {mirror.tally.since}).</div>')


def by_group(u: dict, cfg) -> str:
    """A hybrid pool's card: each kind of group's reservation and paged blocks, then what the
    windows save against full attention on every layer (each group holding what a full one does)."""
    bs, bpb = cfg.block_size, cfg.bytes_per_block
    rows = "".join(
        f'<div>{escape(k.label)}: contiguous <b>{k.reserved:,}</b> slots ({_mib(k.reserved * bpb / bs)}) · '
        f'paged <b>{k.slots:,}</b> slots ({_mib(k.used * bpb)}, {plural(k.used, "block")})</div>' for k in u["kinds"])
    full, held = u["full_everywhere"], u["used"]
    saved = full - held
    window = ""
    if full and saved > 0:
        window = (f'<div style="margin-top:6px">Full attention on every layer would hold '
                  f'<b>{plural(full, "block")}</b> '
                  f'({_mib(full * bpb)}) for these sequences; with the windows the pool holds {held:,}: they save '
                  f'<b>{plural(saved, "block")}</b> (<b>{_mib(saved * bpb)}</b>, {saved / full:.0%}).</div>')
    return f'<div style="margin-top:6px;font-size:12.5px">{rows}</div>{window}'


def summary(reserved: int, paged: int, cfg) -> str:
    """The card's last line: what paging saves, or (big blocks, short sequences) that it holds
    more than the reservation, and why: that is the lesson too."""
    if not reserved or reserved == paged:
        return ""
    diff = abs(reserved - paged)
    size = _mib(diff * cfg.bytes_per_block / cfg.block_size)
    if paged < reserved:
        return (f'<div style="margin-top:6px">Paging holds <b>{plural(diff, "fewer slot")}</b> '
                f'(<b>{size}</b>, {diff / reserved:.0%} less) for the same tokens.</div>')
    return (f'<div style="margin-top:6px">Paging holds <b>{plural(diff, "more slot")}</b> (<b>{size}</b>) than the '
            f'reservation here: with blocks of {plural(cfg.block_size, "token")}, each sequence\'s last block is '
            'mostly empty (internal fragmentation), more than these short reservations leave unused.</div>')
