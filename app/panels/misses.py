"""The "why not more?" panel, opened from the prefix hit rate's chip: the tokens looked up in the
prefix cache by what became of them (hit, or the reason of the miss) over engine steps, the requests
that missed most, each reuse that an eviction came before (select one: travel to the eviction,
its blocks ringed), and what would have hit, from a lab replay of this session's requests
(docs/misses.md)."""
from __future__ import annotations

import copy
from functools import lru_cache

import altair as alt
import pandas as pd
import streamlit as st

from app.link.client import EngineClient, View
from app.derived.session_misses import admissions_between, explained, what_if
from app.ui import travel
from app.ui.palette import ACCENT
from kvscope_contract.counters import hit_rate
from kvscope_contract.misses import LABELS as REASON_LABELS
from kvscope_contract.misses import (REASONS, by_request, evicted_cases, eviction_summary, reason_line,
                                     totals_of)

MAX_BARS = 60
LABELS = {"hit": "hit", **REASON_LABELS}
COLORS = {"hit": "#2563eb", "host_tier": "#0e7490", "evicted": "#e15759", "cold": "#94a3b8", "diverged": "#f28e2b",
          "partial_block": "#edc948", "window": "#17becf", "recomputed": "#b07aa1", "caching_off": "#334155",
          "unknown": "#cbd5e1"}
assert COLORS.keys() == LABELS.keys(), "a reason needs its colour here"
RING = "misses_ring"  # session state: (event, blocks, line) of the eviction travelled to


def open_panel() -> None:
    """The hit-rate chip's button: the history panel shows this one."""
    st.session_state["panel_shown"] = PANEL
    st.session_state["log_version"] = st.session_state.get("log_version", 0) + 1  # remounts the panel picker
    st.rerun(["panel"])


PANEL = "Why not more?"


@lru_cache(maxsize=1)
def _spec() -> dict:
    order = list(LABELS.values())
    bars = alt.Chart(alt.Data(name="bars")).mark_bar().encode(
        x=alt.X("from:Q", bin="binned", title="engine step", axis=alt.Axis(format="d", tickMinStep=1)), x2="to:Q",
        y=alt.Y("tokens:Q", stack="zero", title="tokens looked up"),
        color=alt.Color("what:N", scale=alt.Scale(domain=order, range=[COLORS[k] for k in LABELS]),
                        legend=alt.Legend(orient="top", title=None)),
        order=alt.Order("order:Q"),
        tooltip=[alt.Tooltip("from:Q", title="from step"), alt.Tooltip("to:Q", title="to step"), "what:N", "tokens:Q"])
    cursor = alt.Chart(alt.Data(name="cursor")).mark_rule(color=ACCENT, strokeWidth=2, strokeDash=[4, 3]).encode(
        x="step:Q")
    return alt.layer(bars, cursor).properties(height=220).to_dict()


def chart(admissions: list, at_step: int | None) -> dict:
    """Tokens by what became of them, stacked, in at most MAX_BARS bins of engine steps (an
    admission counts at its step)."""
    lo, hi = min(a.step for a in admissions), max(a.step for a in admissions)
    width = max(1, -(-(hi - lo + 1) // MAX_BARS))
    bins: dict[tuple[int, str], int] = {}
    for a in admissions:
        b = lo + (a.step - lo) // width * width
        if a.hit:
            bins[b, "hit"] = bins.get((b, "hit"), 0) + a.hit
        for s in a.spans:
            bins[b, s.reason] = bins.get((b, s.reason), 0) + s.tokens
    keys = list(LABELS)
    rows = [{"from": b, "to": b + width, "what": LABELS[k], "tokens": n, "order": keys.index(k)}
            for (b, k), n in sorted(bins.items())]
    shown = [k for k in keys if any(k == what for _, what in bins)]  # the legend names only what happened
    spec = copy.deepcopy(_spec())
    bars = spec["layer"][0]["encoding"]["color"]
    bars["scale"] = {"domain": [LABELS[k] for k in shown], "range": [COLORS[k] for k in shown]}
    spec["datasets"] = {"bars": rows, "cursor": [] if at_step is None else [{"step": at_step}]}
    return spec


def panel(client: EngineClient, view: View) -> None:
    h = client.history
    since = h.segment_start(view.event + 1) if h else 0
    x = explained(client, since)
    if x is None:
        return
    adms = admissions_between(x.pool.explainer, since, view.event)
    tl = view.mirror.tally
    if not adms:
        st.caption(f"No sequence has been admitted since {tl.since}: the prefix cache has not been asked yet.")
        return
    t = totals_of(adms)
    why = ", ".join(f"**{LABELS[r]}** {n:,}" for r in REASONS if (n := t.by_reason.get(r))) or "none"
    if t.looked_up:
        st.markdown(f"**{t.hit:,} of {t.looked_up:,} tokens looked up hit ({hit_rate(t.hit, t.looked_up):.0%})** over "
                    f"{t.admissions:,} admissions since {tl.since}; the {t.missed:,} others missed: {why}")
    else:
        st.markdown(f"**Prefix caching is off**: nothing was looked up; the {t.tokens:,} tokens of {t.admissions:,} "
                    f"admissions since {tl.since} were all computed: {why}")
    if loaded := t.by_reason.get("host_tier", 0):  # what the host tier's hits cost: copies, not recomputes
        cfg = view.mirror.config
        blocks, size = loaded // cfg.block_size, cfg.bytes_per_block
        copied = blocks * size
        cost = (f" ({copied / 2**20:,.1f} MiB" if copied >= 2**20 else f" ({copied / 2**10:,.0f} KiB") \
            + " copied from host memory)" if size else ""
        st.caption(f"**{loaded:,} tokens hit in the host tier**: {blocks:,} blocks the device had evicted, loaded "
                   f"back{cost} instead of recomputed (docs/offload.md measures a load against a recompute).")
    recomputed = t.by_reason.get("recomputed", 0)
    if client.hello and client.hello.server.startswith("vllm"):
        first = hit_rate(t.first_hit, t.first_looked_up)
        st.caption(f"vLLM's own counters (its /metrics, `vllm:prefix_cache_hits` / `queries`) count first admissions "
                   f"only: **{t.first_hit:,} of {t.first_looked_up:,}** ({first:.0%}); "
                   f"they leave out re-admissions after a preemption, whose {recomputed:,} missed tokens are "
                   "*recomputed after preemption* here. The other reasons add up to vLLM's queries less its hits.")
    elif t.first_looked_up != t.looked_up:
        st.caption(f"vLLM's definition leaves re-admissions after a recompute out: {t.first_hit:,} of "
                   f"{t.first_looked_up:,} ({hit_rate(t.first_hit, t.first_looked_up):.0%}); their misses are "
                   "*recomputed after preemption* here.")
    if x.rebuilt:
        st.caption(f"This stream carries no prompt token ids: {x.rebuilt} prompts were rebuilt from their block "
                   "hashes, so a prompt that parts from another inside a block shows as cold, not diverged.")
    at_step = None if view.live else (view.step_events[-1].step if view.step_events else None)
    st.vega_lite_chart(chart(adms, at_step), width="stretch", key="misses_chart")
    left, right = st.columns(2)
    with left:
        requests(adms)
    with right:
        evictions(adms)
    what_would_have_hit(client, since, len({a.request_id for a in adms}))
    with st.expander("What each reason means"):
        st.markdown("\n".join(f"- **{LABELS[r]}**: {REASONS[r]}" for r in REASONS)
                    + "\n\nEach missed token has one reason; they add up to the misses exactly (docs/misses.md).")


def requests(adms: list) -> None:
    st.markdown("**The requests that missed most**")
    rows = [{"request": r.request_id, "looked up": r.tokens, "hit": r.hit, "missed": r.missed,
             "why": reason_line(r.by_reason(), words=True)} for r in by_request(adms) if r.missed][:50]
    st.dataframe(pd.DataFrame(rows, columns=["request", "looked up", "hit", "missed", "why"]), hide_index=True,
                 height=240, width="stretch", key="misses_requests",
                 column_config={"why": st.column_config.TextColumn(width="large")})


def evictions(adms: list) -> None:
    st.markdown("**Evicted before reuse**")
    cases = []
    for a, s in evicted_cases(adms):
        by_step: dict[int, list] = {}
        for e in s.evictions:  # a reuse whose blocks went in several steps: one row per step
            by_step.setdefault(e.step, []).append(e)
        for step, group in sorted(by_step.items(), reverse=True):
            cases.append((a, s, tuple(group)))
    if not cases:
        st.caption("No token missed because it was evicted: the pool kept everything that was asked for again.")
        return
    shown = cases[:200]
    st.session_state["misses_cases"] = [(max(e.event for e in g), [e.block_id for e in g],
                                         f"{a.seq_id} needed tokens {s.start}-{s.end} again at event {a.event:,} "
                                         f"(step {a.step}): {eviction_summary(g)}") for a, s, g in shown]
    rows = [{"needed by": a.seq_id, "at event": a.event, "tokens": f"{s.start}-{s.end}",
             "evicted at": max(e.event for e in g), "step": g[0].step, "blocks": ", ".join(str(e.block_id) for e in g),
             "by": ", ".join(sorted({e.by_request or e.by_seq for e in g if e.by_seq})) or "clearing the cache"}
            for a, s, g in shown]
    st.dataframe(pd.DataFrame(rows), hide_index=True, height=240, width="stretch", key="misses_evictions",
                 on_select=_travel_to_eviction, selection_mode="single-row")
    st.caption("Select a row to travel to the eviction, its blocks ringed in the grid; **Live** returns.")


def _travel_to_eviction() -> None:
    rows = st.session_state["misses_evictions"].selection.rows
    if rows:
        event, blocks, line = st.session_state["misses_cases"][rows[0]]
        st.session_state[RING] = (event, blocks, line)
        travel.go(event)


def ring(view: View) -> tuple[list[int], str] | None:
    """The blocks and line of the eviction travelled to from this panel, while the views show it."""
    r = st.session_state.get(RING)
    return (r[1], r[2]) if r and not view.live and view.event == r[0] else None


def what_would_have_hit(client: EngineClient, since: int, requests_seen: int) -> None:
    st.markdown("**What would have hit**")
    done, running = what_if(client, since, requests_seen)
    if done is None:
        st.caption("Replaying this session's requests through the lab…" if running else
                   "Appears once this session has requests to replay.")
        return
    if done.error:
        st.caption(f"The lab's replay failed: {done.error}")
        return
    if not done.lines:
        st.caption("No request of this session has run to a first token yet: nothing to replay.")
        return
    base, *rest = done.lines
    st.markdown("\n".join(f"- {line}" for line in rest))
    st.caption(f"A replay of this session's {done.requests:,} requests (events {done.since + 1:,}-{done.upto:,}) "
               "through the lab: "
               f"the real scheduler and block manager, no model, outputs as they came; {base}."
               + (" A newer replay is running." if running else "")
               + "".join(f" {n}." for n in done.notes))
