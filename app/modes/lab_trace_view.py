"""The Lab's third workload, a request trace: how big must the pool be for this traffic, and which
eviction policy gets the most of it? Hit rate against capacity, per policy, beside the trace's reuse
ceiling, each point's misses by reason (docs/traces.md).

The trace goes through the engine's real scheduler and block manager in a child process,
`python -m engine.lab trace:PATH ... --json` (app/link/lab_run.py `run_sweep`); the dashboard
reads the `kvscope_contract.lab.TraceSweep` it prints and never imports the engine.
"""
from __future__ import annotations

import csv
import io
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from kvscope_contract.lab import TRACE_REASONS, TracePoint, TraceSweep
from app.link.lab_run import run_sweep, sweep_args
from app.link.source import ASSETS, ROOT, Source
from app.ui import stale, travel

# where a checkout keeps the Mooncake FAST'25 traces, if it has them (never needed: a user's own file works)
MOONCAKE_DIRS = (ROOT.parent / "shared" / "traces" / "mooncake", ROOT / "shared" / "traces" / "mooncake")
# its first 1,000 requests, bundled (assets/mooncake/README.md: source and licence): on every machine
BUNDLED = {"Mooncake conversation, first 1,000 (bundled)": ASSETS / "mooncake" / "conversation_trace_first1000.jsonl"}
BLOCK_SIZES = [2 ** k for k in range(10)]  # the divisors of the trace's 512-token blocks
POLICIES = {"lru": "LRU (vLLM v1's)", "lfu": "LFU", "opt": "OPT (Belady, clairvoyant)"}
POLICY_COLORS = {"lru": "#4e79a7", "lfu": "#59a14f", "opt": "#e15759"}
OTHER_COLORS = ("#f28e2b", "#b07aa1", "#9c755f", "#17becf")  # a policy of the user's own
MODELS = {"SmolLM2-135M": "smollm2", "Gemma 3 270M": "gemma3", "Bytes per token…": "bytes", "No bytes": None}
PAPER_BYTES_PER_TOKEN = 327_680  # the Mooncake paper's 320 KB/token
REASONS = {"cold": "cold", "evicted": "evicted", "in_flight": "in flight", "partial_block": "partial block",
           "recomputed": "recomputed"}
CEILING = "#334155"
PLAYING = "trace_playing"  # session state: the sweep whose curve the played point is marked on (trace_play_view)
PLAY_ERROR = "trace_play_error"  # session state: why the last Play was refused
PRODUCTION_BLOCKS = 1 << 20  # a production pool: 1,048,576 blocks
DEFAULT_POINTS = 12  # engine/lab/trace_sweep.py POINTS: the capacities it picks when none is given


def mooncake_traces() -> dict[str, Path]:
    """The Mooncake traces found beside the checkout, by a label, then the bundled slice."""
    for folder in MOONCAKE_DIRS:
        found = {f"Mooncake {f.stem.removesuffix('_trace')}": f for f in sorted(folder.glob("*_trace.jsonl"))}
        if found:
            return found | BUNDLED
    return dict(BUNDLED)


def _capacities(text: str) -> list[int]:
    out = [int(x.replace("_", "")) for x in text.replace(" ", "").split(",") if x]
    if any(n < 1 for n in out):
        raise ValueError
    return sorted(set(out))


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:,.3g} {unit}" if n < 100 * size else f"{n / size:,.0f} {unit}"
    return f"{n} B"


def page() -> None:
    """The inputs, the Run button, and the last sweep's chart and table."""
    traces = mooncake_traces()
    c = st.columns([2, 3])
    with c[0]:
        where = st.radio("Trace", [*traces, "A file on this machine", "Upload"], key="lab_trace_from", horizontal=True,
                         help="JSONL in the Mooncake format: timestamp, input_length, output_length, hash_ids "
                              "(one prefix-chained id per 512-token block); docs/traces.md")
        upload = None
        if where == "A file on this machine":
            path = st.text_input("Trace file", key="lab_trace_path", placeholder="/path/to/trace.jsonl")
        elif where == "Upload":
            upload = st.file_uploader("Trace file", type=["jsonl", "json", "txt"], key="lab_trace_upload")
            path = ""
        else:
            path = str(traces[where])
            st.caption(f"`{os.path.relpath(path)}`")
        requests = st.number_input("First N requests (0: the whole file)", 0, 10_000_000, 500, step=100,
                                   key="lab_trace_requests",
                                   help="A few hundred run in seconds; the whole conversation trace takes minutes "
                                        "a capacity.")
        one = st.toggle("One request at a time", key="lab_trace_one",
                        help="Admit each request once the one before finished, timestamps aside: a plain cache "
                             "simulation (the Mooncake paper's), whose unlimited pool reaches the ceiling exactly. "
                             "Off: arrivals at their timestamps, 50 ms an engine step of up to 8,192 tokens.")
    with c[1]:
        cc = st.columns([1, 2])
        block_size = cc[0].selectbox("Block size", BLOCK_SIZES, index=BLOCK_SIZES.index(512), key="lab_trace_bs",
                                     help="Tokens per block, a divisor of 512: the trace only says which "
                                          "512-token blocks are shared.")
        policies = cc[1].multiselect("Eviction policies", list(POLICIES), default=list(POLICIES),
                                     format_func=lambda x: POLICIES.get(x, x), key="lab_trace_policies",
                                     accept_new_options=True,
                                     help="LRU as vLLM v1, LFU, Belady's OPT (the bound at each capacity, one "
                                          "request at a time), or your own class by its import path, e.g. "
                                          "`mypolicies:MRU` (docs/traces.md, *Your own policy*).")
        cc = st.columns([1, 1, 1])
        capacities = cc[0].text_input("Capacities (blocks)", "", key="lab_trace_caps",
                                      placeholder=f"{DEFAULT_POINTS} log-spaced points, or e.g. 500,2000",
                                      help="Comma-separated pool sizes in blocks. Empty: "
                                           f"{DEFAULT_POINTS} log-spaced up to a pool that never evicts.")
        host = int(cc[2].number_input("Host tier (blocks)", 0, 1 << 24, 0, step=1000, key="lab_trace_host",
                                      help="0: the device pool alone. N: each point also with a host tier of N "
                                           "blocks (vLLM v1's CPU offloading, docs/offload.md): blocks stored as "
                                           "they complete, a device miss loaded back from it, its own LRU; drawn "
                                           "dashed, device and host hits together."))
        model_label = cc[1].selectbox("Capacity in bytes for", list(MODELS), key="lab_trace_model",
                                      help="KV bytes per token from the model's config (every layer's K and V "
                                           "in bf16), or a model given by its numbers.")
        model, per_token = MODELS[model_label], None
        if model == "bytes":
            model = None
            per_token = int(st.number_input("KV bytes per token", 1, 10 ** 9, PAPER_BYTES_PER_TOKEN,
                                            key="lab_trace_bpt", help="The Mooncake paper's 320 KB/token: 327,680"))
    try:
        caps = _capacities(capacities)
    except ValueError:
        st.error("Capacities take comma-separated positive numbers of blocks.")
        return
    if st.button("Run the sweep", type="primary", icon=":material/science:", key="lab_trace_run"):
        run(path, upload, policies, caps, int(requests) or None, block_size, one, model, per_token, host)
    sweep: TraceSweep | None = st.session_state.get("lab_sweep")
    if sweep is not None:
        show(sweep, st.session_state.get("lab_sweep_command", ""))
    play_form(sweep, path, upload, policies, int(requests) or None, block_size, one)


def run(path: str, upload, policies: list[str], caps: list[int], requests: int | None, block_size: int,
        one: bool, model: str | None, per_token: int | None, host: int = 0) -> None:
    """Run the sweep; a failure (a bad trace line names its file:line) is said as an error and
    leaves no result drawn."""
    st.session_state.pop("lab_sweep", None)
    if not policies:
        st.error("Choose at least one eviction policy.")
        return
    if upload is None and not path.strip():
        st.error("Give a trace: a path on this machine, or upload a file.")
        return
    total = len(policies) * (len(caps) or DEFAULT_POINTS) * (2 if host else 1)
    bar = st.progress(0.0, text="Reading the trace…")
    done = [0]

    def progress(line: str) -> None:
        if " blocks: hit rate " in line:
            done[0] += 1
            bar.progress(min(1.0, done[0] / total), text=f"{done[0]} of ~{total} replays: {line}")

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(path.strip()).expanduser()
        name = str(trace)
        if upload is not None:
            name = Path(upload.name).name
            trace = Path(tmp) / name
            trace.write_bytes(upload.getvalue())
        kwargs = dict(requests=requests, block_size=block_size, one_at_a_time=one, model=model,
                      bytes_per_token=per_token, host_blocks=host)
        try:
            sweep = run_sweep(trace, policies, caps or None, progress=progress, **kwargs)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            bar.empty()
            message = str(e).removeprefix("engine.lab: ").replace(str(trace.absolute()), name)
            st.error(f"The trace sweep failed: {message}")
            return
    bar.empty()
    sweep.trace = name
    st.session_state["lab_sweep"] = sweep
    argv = sweep_args(name, policies, caps or None, **kwargs)
    st.session_state["lab_sweep_command"] = "python -m engine.lab " + shlex.join(argv)


def tiered(s: TraceSweep) -> bool:
    """Whether the sweep has points with a host tier (each beside its device-only twin)."""
    return any(pt.host_blocks for pt in s.points)


def series(pt: TracePoint) -> str:
    """A point's line on the chart: its policy, and its host tier if it has one."""
    return f"{pt.policy} + host tier of {pt.host_blocks:,}" if pt.host_blocks else f"{pt.policy}, device only"


def point_row(s: TraceSweep, pt: TracePoint) -> dict:
    """One point as the table shows it: capacity three ways, the hit rate, the misses as shares
    of the tokens looked up (as the CLI's table), and the counts."""
    look = max(1, pt.looked_up_tokens)
    tier = {"host tier": pt.host_blocks, "device + host": pt.tier_hit_rate} if tiered(s) else {}
    return {"policy": pt.policy, "blocks": pt.blocks, "tokens": pt.tokens, "KV bytes": _bytes(pt.bytes),
            "hit rate": pt.hit_rate, **tier, "of ceiling": pt.tier_hit_rate / s.ceiling if s.ceiling else None,
            **{REASONS[r]: pt.missed.get(r, 0) / look for r in TRACE_REASONS},
            "evictions": pt.evictions, "preemptions": pt.preemptions, "rejected": pt.rejected,
            "hit tokens": pt.hit_tokens, "looked up": pt.looked_up_tokens}


def to_csv(s: TraceSweep) -> str:
    """Every point with exact counts: the misses in tokens, by reason."""
    heads = ["policy", "blocks", "tokens", "bytes", "hit_tokens", "looked_up_tokens", "hit_rate",
             *(f"missed_{r}" for r in TRACE_REASONS), "evictions", "preemptions", "rejected", "finished", "steps",
             "host_blocks", "host_hit_tokens"]
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(heads)
    for pt in s.points:
        w.writerow([pt.policy, pt.blocks, pt.tokens, "" if pt.bytes is None else pt.bytes, pt.hit_tokens,
                    pt.looked_up_tokens, round(pt.hit_rate, 6), *(pt.missed.get(r, 0) for r in TRACE_REASONS),
                    pt.evictions, pt.preemptions, pt.rejected, pt.finished, pt.steps, pt.host_blocks,
                    pt.host_hit_tokens])
    return out.getvalue()


def chart(s: TraceSweep, playing: dict | None = None, height: int = 340) -> dict:
    """Hit rate against capacity (log blocks; tokens on the top axis), a line and points per
    policy, the ceiling a labelled rule. Each point's description (its aria-label in the SVG)
    carries its exact counts. `playing`: the point a trace replay is playing, marked (policy,
    blocks, hit rate, description: app/modes/trace_play_view.py)."""
    rows = []
    for pt in s.points:  # a point with a host tier: its device and host hits together, on a dashed line
        host = f" + a host tier of {pt.host_blocks}: {pt.host_hit_tokens} more from it" if pt.host_blocks else ""
        rows.append({**{k: v for k, v in point_row(s, pt).items() if k != "KV bytes"}, "bytes": _bytes(pt.bytes),
                     "hit rate": pt.tier_hit_rate, "device hit rate": pt.hit_rate, "series": series(pt),
                     "tier": "device + host tier" if pt.host_blocks else "device only",
                     "description": f"{pt.policy} at {pt.blocks} blocks: {pt.hit_tokens} of {pt.looked_up_tokens} "
                                    f"tokens hit, {pt.evictions} evictions{host}"})
    top = max([s.ceiling, *(pt.tier_hit_rate for pt in s.points)] or [0.0])
    xs = [pt.blocks for pt in s.points] + ([playing["blocks"]] if playing else []) or [1]
    lo, hi = min(xs) / 1.15, max(xs) * 1.15
    x_scale = alt.Scale(type="log", domain=[lo, hi], nice=False)
    ticks = (sorted(set(xs)) if len(set(xs)) <= 6 else  # a few capacities of the user's: each labelled
             [m * 10 ** e for e in range(0, 10) for m in (1, 2, 5) if lo <= m * 10 ** e <= hi] or xs)
    y = alt.Y("hit rate:Q", title="token hit rate" + (" (device and host tier)" if tiered(s) else ""),
              axis=alt.Axis(format="%"),
              scale=alt.Scale(domain=[0, max(top * 1.15, 0.01)], nice=False))
    policies = [p for p in POLICIES if any(pt.policy == p for pt in s.points)] + \
        sorted({pt.policy for pt in s.points} - set(POLICIES))
    others = iter(OTHER_COLORS * len(policies))
    color = alt.Color("policy:N", scale=alt.Scale(domain=policies, range=[POLICY_COLORS.get(p) or next(others)
                                                                          for p in policies]),
                      legend=alt.Legend(orient="top", title=None, labelExpr="upper(datum.label)"))
    tooltip = ["policy:N", alt.Tooltip("blocks:Q", format=","), alt.Tooltip("tokens:Q", format=","),
               alt.Tooltip("bytes:N", title="KV bytes" + (f" ({s.model})" if s.model else "")),
               alt.Tooltip("hit rate:Q", format=".2%"), alt.Tooltip("of ceiling:Q", format=".0%"),
               *(alt.Tooltip(f"{label}:Q", format=".1%", title=f"missed: {label}") for label in REASONS.values()),
               alt.Tooltip("evictions:Q", format=","), alt.Tooltip("preemptions:Q", format=","),
               alt.Tooltip("rejected:Q", format=",")]
    by_tier = {}
    if tiered(s):  # each policy twice: device only (solid) and with the host tier (dashed)
        tooltip[1:1] = ["tier:N", alt.Tooltip("host tier:Q", format=","),
                        alt.Tooltip("device hit rate:Q", format=".2%")]
        by_tier = dict(strokeDash=alt.StrokeDash("tier:N", legend=alt.Legend(orient="top", title=None),
                                                 scale=alt.Scale(domain=["device only", "device + host tier"],
                                                                 range=[[1, 0], [6, 3]])),
                       detail="series:N")
    # each tick in blocks, tokens and (a model named) bytes, one line each
    lines_expr = ["format(datum.value, ',')", f"format(datum.value * {s.block_size}, '.3~s') + ' tokens'"]
    if s.bytes_per_token:
        gib = s.block_size * s.bytes_per_token / 2 ** 30
        lines_expr.append(f"(datum.value * {gib!r} >= 1024 ? format(datum.value * {gib!r} / 1024, '.3~r') + ' TiB' : "
                          f"datum.value * {gib!r} >= 1 ? format(datum.value * {gib!r}, '.3~r') + ' GiB' : "
                          f"format(datum.value * {gib!r} * 1024, '.3~r') + ' MiB')")
    title = (f"pool capacity (log scale): blocks of {s.block_size}, tokens"
             + (f", KV bytes of {s.model or f'{s.bytes_per_token:,} B/token'}" if s.bytes_per_token else ""))
    base = alt.Chart(alt.Data(values=rows)).encode(
        x=alt.X("blocks:Q", scale=x_scale, title=title,
                axis=alt.Axis(labelExpr="[" + ", ".join(lines_expr) + "]", grid=True, labelFlush=False,
                              values=ticks, labelPadding=4)),
        y=y, color=color, **by_tier)
    lines = base.mark_line(strokeWidth=2, opacity=0.8)
    points = base.mark_point(filled=True, size=60, opacity=1).encode(
        tooltip=tooltip, description=alt.Description("description:N"))
    label = f"ceiling {s.ceiling:.1%}: an unlimited pool, one request at a time"
    ceiling = alt.Chart(alt.Data(values=[{"ceiling": s.ceiling, "label": label}]))
    rule = ceiling.mark_rule(color=CEILING, strokeDash=[6, 4], strokeWidth=1.5).encode(
        y="ceiling:Q", tooltip=[alt.Tooltip("ceiling:Q", format=".2%", title="ceiling")],
        description=alt.Description("label:N"))
    text = ceiling.mark_text(align="left", baseline="bottom", dx=4, dy=-4, color=CEILING, fontSize=12).encode(
        x=alt.value(0), y="ceiling:Q", text="label:N")
    layers = [lines, points, rule, text]
    if playing:
        played = alt.Chart(alt.Data(values=[playing])).encode(x="blocks:Q", y="hit rate:Q")
        layers += [played.mark_point(shape="diamond", size=320, filled=True, stroke="#111827", strokeWidth=2,
                                     opacity=1).encode(color=color, description=alt.Description("description:N"),
                                                       tooltip=[alt.Tooltip("description:N", title="playing")]),
                   played.mark_text(align="right", baseline="bottom", dx=-10, dy=-8, fontSize=12,
                                    fontWeight="bold").encode(text="label:N")]
    spec = alt.layer(*layers).properties(height=height).to_dict()
    # svg: each point is an element with its description as aria-label (screen readers; the browser test)
    spec["usermeta"] = {"embedOptions": {"renderer": "svg"}}
    return spec


def show(s: TraceSweep, command: str = "") -> None:
    mode = ("one request at a time" if s.one_at_a_time else
            f"arrivals at their timestamps ({s.step_ms:g} ms a step of up to {s.max_num_batched_tokens:,} tokens)")
    size = (f" · KV bytes{f' of {s.model}' if s.model else ''} at {s.bytes_per_token:,} B/token"
            if s.bytes_per_token else "")
    st.markdown(f"**{Path(s.trace).name}** · first {s.requests:,} requests · {s.prompt_tokens:,} prompt tokens · "
                f"blocks of {s.block_size} · {mode}{size} · {len(s.points)} replays in {s.seconds:.1f} s")
    st.caption(f"Ceiling {s.ceiling:.1%} ({s.ceiling_hit_tokens:,} tokens): every leading block an earlier prompt "
               f"held, never a prompt's last token; a pool of {s.unlimited_blocks:,} blocks never evicts. "
               "Misses are shares of the tokens looked up: cold (never cached), evicted (cached before: a bigger "
               "pool or a better policy keeps it), in flight (a running request was still computing it), partial "
               "block (the block of the prompt's last token), recomputed (re-admissions after a preemption). "
               "docs/traces.md says how a trace is replayed."
               + (" Dashed: the same device pool with a host tier (docs/offload.md); its hit rate counts the "
                  "tokens the device missed and the host tier served, which are loaded back, not recomputed."
                  if tiered(s) else ""))
    st.vega_lite_chart(chart(s), width="stretch", key="lab_trace_chart")
    df = pd.DataFrame([point_row(s, pt) for pt in s.points])
    pct = {name: st.column_config.NumberColumn(name, format="percent")
           for name in ("hit rate", "device + host", "of ceiling", *REASONS.values())}
    st.dataframe(df, hide_index=True, width="stretch", key="lab_trace_table", column_config={
        **pct, "blocks": st.column_config.NumberColumn("blocks", format="localized"),
        "tokens": st.column_config.NumberColumn("tokens", format="localized"),
        **{name: st.column_config.NumberColumn(name, format="localized")
           for name in ("host tier", "evictions", "preemptions", "rejected", "hit tokens", "looked up")}})
    cc = st.columns([1, 4])
    cc[0].download_button("Download CSV", to_csv(s), file_name=f"{Path(s.trace).stem}_sweep.csv", mime="text/csv",
                          icon=":material/download:", key="lab_trace_csv")
    if command:
        cc[1].code(command, language="bash", wrap_lines=True)


# ------------------------------------------------------------------ watch it in the pool
def play_form(sweep: TraceSweep | None, path: str, upload, policies: list[str], requests: int | None,
         block_size: int, one: bool) -> None:
    """Play the chosen trace at one capacity under one policy, in the pool."""
    st.subheader("Watch it in the pool")
    st.caption("One capacity under one policy, played step by step through the real allocator: every "
               "block it hands out, hits and evicts in the grid, with time travel, the misses panel and "
               "the block tables; the sweep's curve above the pool marks the point being played.")
    c = st.columns([1, 1, 1, 1])
    c[0].number_input("Pool (blocks)", 1, 1 << 20, PRODUCTION_BLOCKS, step=1024, key="play_blocks",
                      help="Up to 1,048,576 blocks: a production pool")
    c[1].selectbox("Policy", policies or ["lru"], format_func=lambda x: POLICIES.get(x, x),
                            key="play_policy")
    c[2].number_input("Step pace (ms)", 0, 5000, 50, step=10, key="play_pace",
                             help="Wall time between engine steps; the sidebar's pace changes it while it plays")
    c[3].button("Play in the pool", type="primary", icon=":material/play_arrow:", key="play_trace",
                disabled=upload is None and not path.strip(), on_click=_play,
                args=(sweep, path, upload, ["--block-size", str(block_size),
                                            *(["--requests", str(requests)] if requests else []),
                                            *(["--one-at-a-time"] if one else [])]))
    if error := st.session_state.pop(PLAY_ERROR, None):
        st.error(error)


def _play(sweep: TraceSweep | None, path: str, upload, args: list[str]) -> None:
    """The Play click's callback (before the mode's widget is drawn): the trace becomes the source,
    the page the live pool. The play's own inputs are read here, as they are at the click."""
    ss = st.session_state
    args = ["--blocks", str(ss["play_blocks"]), "--policy", ss["play_policy"] or "lru",
            "--step-delay-ms", f"{ss['play_pace']:g}", *args]
    trace = Path(path.strip()).expanduser()
    if upload is not None:  # the player runs apart: it needs the file on disk for as long as it plays
        trace = Path(tempfile.mkdtemp(prefix="kvscope-trace-")) / Path(upload.name).name
        trace.write_bytes(upload.getvalue())
    if not trace.is_file():
        st.session_state[PLAY_ERROR] = f"No trace at {trace}"
        return
    st.session_state[PLAYING] = sweep
    st.session_state["source"] = Source("trace", path=str(trace.resolve()), engine_args=tuple(args))
    st.session_state["mode"] = "Explore"
    travel.go_live()
    stale.mark()
