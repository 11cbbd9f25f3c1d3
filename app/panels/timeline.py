"""Timeline charts (Altair, a few hundred marks at most): device blocks by state over engine
steps with markers at preemptions, swaps and resets; prefix hit rate and throughput.

The charts are declared (and validated) once with named data sources; each redraw only
fills in the rows, which keeps a redraw at a few milliseconds instead of ~70 ms of schema
validation per chart.
"""
from __future__ import annotations

import copy
from functools import lru_cache

import altair as alt

from kvscope_contract.kinds import KINDS, MARKER_KINDS
from app.history.event_history import Marker, StepPoint
from app.ui.palette import ACCENT, BLOCK_STATE_COLORS, LIVE

MAX_POINTS, MAX_MARKERS = 400, 150
STEP_AXIS = alt.Axis(format="d", tickMinStep=1)  # steps are whole numbers: no 1.5 ticks
STATES = ("used", "cached", "free")
MARKERS = tuple(k for k in KINDS if k in MARKER_KINDS)
CURSOR = alt.Chart(alt.Data(name="cursor")).mark_rule(color=ACCENT, strokeWidth=2, strokeDash=[4, 3]).encode(
    x="step:Q", tooltip=[alt.Tooltip("step:Q", title="viewing step")])


@lru_cache(maxsize=1)
def _blocks_spec() -> dict:
    area = alt.Chart(alt.Data(name="blocks")).mark_area(interpolate="step-after", opacity=0.9).encode(
        x=alt.X("step:Q", title="engine step", axis=STEP_AXIS),
        y=alt.Y("blocks:Q", stack="zero", title="device blocks"),
        color=alt.Color("state:N", scale=alt.Scale(domain=list(STATES), range=[BLOCK_STATE_COLORS[s] for s in STATES]),
                        legend=alt.Legend(orient="top", title=None)),
        order="order:Q", tooltip=["step:Q", "state:N", "blocks:Q"])
    marks = alt.Chart(alt.Data(name="markers")).mark_rule(strokeWidth=1.5, opacity=0.85).encode(
        x="step:Q", color=alt.Color("event:N", scale=alt.Scale(
            domain=[m.replace("_", " ") for m in MARKERS], range=[KINDS[m].color for m in MARKERS]),
            legend=alt.Legend(orient="top", title=None)),
        tooltip=["event:N", "sequence:N", "step:Q", alt.Tooltip("seq:Q", title="event #")])
    return alt.layer(area, marks, CURSOR).resolve_scale(color="independent").properties(height=230).to_dict()


@lru_cache(maxsize=1)
def _rates_spec() -> dict:
    base = alt.Chart(alt.Data(name="rates")).encode(x=alt.X("step:Q", title="engine step", axis=STEP_AXIS))
    hit = base.mark_line(color=KINDS["prefix_hit"].color, interpolate="step-after").encode(
        y=alt.Y("hit_rate:Q", title="prefix hit rate", axis=alt.Axis(format="%", titleColor=KINDS["prefix_hit"].color),
                scale=alt.Scale(domain=[0, 1])),
        tooltip=["step:Q", alt.Tooltip("hit_rate:Q", format=".1%", title="hit rate")])
    tps = base.mark_line(color=LIVE, opacity=0.85).encode(
        y=alt.Y("tokens_per_s:Q", title="tokens/s", axis=alt.Axis(titleColor=LIVE)),
        tooltip=["step:Q", alt.Tooltip("tokens_per_s:Q", format=".1f", title="tokens/s")])
    return alt.layer(hit, tps, CURSOR).resolve_scale(y="independent").properties(
        height=230, title=alt.TitleParams("prefix hit rate (blue) and tokens/s (green)", fontSize=12,
                                          anchor="start", fontWeight="normal")).to_dict()


def _thin(points: list[StepPoint]) -> list[StepPoint]:
    k = -(-len(points) // MAX_POINTS)
    return points if k <= 1 else points[::k] + ([points[-1]] if (len(points) - 1) % k else [])


def _with(spec: dict, **datasets: list[dict]) -> dict:
    """`spec` with its rows; a layer after the first whose rows are empty (no markers yet, no
    cursor while live) is left out: Vega warns of an infinite extent for each empty one."""
    out = copy.copy(spec)
    first, *rest = spec["layer"]
    out["layer"] = [first] + [layer for layer in rest if datasets.get(layer.get("data", {}).get("name"))]
    out["datasets"] = {name: rows for name, rows in datasets.items()
                       if rows or name == first.get("data", {}).get("name")}
    return out


def blocks_chart(points: list[StepPoint], markers: list[Marker], at_step: int | None, total: int) -> dict:
    """Blocks by state over the steps, on a scale of the pool's `total` blocks."""
    rows = [{"step": pt.step, "state": s, "blocks": getattr(pt, s), "order": i}
            for pt in _thin(points) for i, s in enumerate(STATES)]
    marks = [{"step": m.step, "event": m.kind.replace("_", " "), "sequence": m.seq_id, "seq": m.seq}
             for m in markers[-MAX_MARKERS:]]
    spec = _with(_blocks_spec(), blocks=rows, markers=marks, cursor=[] if at_step is None else [{"step": at_step}])
    area, *rest = spec["layer"]
    y = {**area["encoding"]["y"], "scale": {"domain": [0, total]}}
    spec["layer"] = [{**area, "encoding": {**area["encoding"], "y": y}}, *rest]
    return spec


def rates_chart(points: list[StepPoint], at_step: int | None) -> dict:
    rows = [{"step": pt.step, "hit_rate": pt.hit_rate, "tokens_per_s": round(pt.tokens_per_s, 2)}
            for pt in _thin(points)]
    return _with(_rates_spec(), rates=rows, cursor=[] if at_step is None else [{"step": at_step}])
