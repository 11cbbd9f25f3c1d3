"""The Lab: one workload under several allocator configs, side by side, in seconds; or a request
trace at several pool capacities and eviction policies (app/modes/lab_trace_view.py).

The dashboard never imports the engine (it may run apart from it): the lab runs as
`python -m engine.lab ... --json` (app/link/lab_run.py) and its report comes back through the
contract (kvscope_contract/lab.py). The current session's requests go to it as a recording.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from kvscope_contract import protocol as p
from kvscope_contract.lab import COLUMNS, PRESETS, LabReport, LabRow, row_values, to_csv
from kvscope_contract.state import SHARED, USED as USED_STATE
from app.link.client import EngineClient
from app.link.lab_run import run_lab, session_recording
from app.ui.palette import USED, block_color
from app.link.source import recordings
from app.modes import lab_trace_view, trace_lesson_view

# what a preset runs on (engine/lab/workload.py)
PRESET_POOL = (p.PoolConfig().num_device_blocks, p.PoolConfig().block_size)
SLOTS = PRESET_POOL[0] * PRESET_POOL[1]


def _numbers(text: str, cast) -> list:
    return [cast(x) for x in text.replace(" ", "").split(",") if x]


def page(client: EngineClient) -> None:
    st.subheader("Lab: one workload, several allocator configs")
    source = st.radio("Workload", ["Preset", "This session's requests", "Recording", "Trace"], key="lab_source",
                      horizontal=True, help="Trace: a production request trace (the Mooncake format), hit rate "
                                            "against pool capacity per eviction policy")
    if source == "Trace":
        st.caption("Each request of the trace goes through the engine's real scheduler and block manager, with no "
                   "model (prompts are the trace's block hash ids), at each pool capacity under each eviction "
                   "policy: the token hit rate against capacity, beside the trace's exact reuse ceiling, each "
                   "point's misses by reason.")
        st.fragment(trace_lesson_view.panel, run_every=trace_lesson_view.REDRAW_S)()
        return lab_trace_view.page()
    st.caption("The workload's token streams go through the engine's real scheduler and block manager under "
               "each config, with no model: each sample's outputs are replayed. A block size given without "
               "device blocks keeps the memory of the workload's pool, not the live engine's: a preset's "
               f"{PRESET_POOL[0]:,} × {PRESET_POOL[1]} ({SLOTS:,} token slots: "
               + ", ".join(f"{SLOTS // bs:,} × {bs}" for bs in (4, 16, 64))
               + "), or the pool a recording (this session's requests included) started on.")
    c = st.columns([2, 3])
    with c[0]:
        if source == "Preset":
            preset = st.selectbox("Preset", list(PRESETS), format_func=PRESETS.get, key="lab_preset")
            scale = st.number_input("Repeat the mix", 1, 200, 1, key="lab_scale")
            workload, extra = preset, ["--scale", str(int(scale))]
        elif source == "Recording":
            files = [str(f) for f in recordings()]
            workload = st.selectbox("Recording", files, format_func=lambda f: Path(f).name, key="lab_file")
            extra = []
        else:
            workload, extra = "", []
            st.caption("Every request this page has seen (its retained history), prompts and outputs as they ran.")
    with c[1]:
        cc = st.columns(2)
        sizes = cc[0].multiselect("Block sizes", p.BLOCK_SIZES, default=[4, 16, 64], key="lab_bs")
        blocks = cc[1].text_input("Device blocks", "", key="lab_blocks", placeholder="keep memory, or e.g. 64,128",
                                  help="Comma-separated. Empty: each block size gets the memory of the workload's "
                                       f"pool (the recording's, or {PRESET_POOL[0]:,} × {PRESET_POOL[1]} for a "
                                       "preset).")
        cc = st.columns(3)
        caching = cc[0].multiselect("Prefix caching", ["on", "off"], default=["on"], key="lab_caching")
        modes = cc[1].multiselect("Preemption", ["swap", "recompute"], default=["swap"], key="lab_modes")
        watermark = cc[2].text_input("Watermark", "0.01", key="lab_wm", help="Fraction of device blocks kept "
                                     "free when admitting; comma-separated to compare several")
    try:
        args = extra + (["--block-sizes", ",".join(map(str, sizes))] if sizes else []) + \
            (["--blocks", ",".join(map(str, _numbers(blocks, int)))] if blocks.strip() else []) + \
            (["--caching", ",".join(caching)] if caching else []) + \
            (["--preemption", ",".join(modes)] if modes else []) + \
            (["--watermark", ",".join(map(str, _numbers(watermark, float)))] if watermark.strip() else [])
    except ValueError:
        st.error("Device blocks and watermark take comma-separated numbers.")
        return
    if st.button("Run the lab", type="primary", icon=":material/science:", key="lab_run"):
        with st.spinner("Running…"), tempfile.TemporaryDirectory() as tmp:
            try:
                if source == "This session's requests":
                    path = session_recording(client, Path(tmp))
                    if path is None:
                        st.warning("This page has not seen a request yet: submit a prompt or run a scenario first.")
                        return
                    workload = str(path)
                st.session_state["lab_report"] = run_lab(workload, args)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                st.error(f"The lab failed: {e}")
    report: LabReport | None = st.session_state.get("lab_report")
    if report is not None:
        show(report)


def show(report: LabReport) -> None:
    total = report.workload_tokens * len(report.rows)
    st.markdown(f"**{report.workload}** · {report.requests:,} requests · {report.sequences:,} sequences · "
                f"{report.workload_tokens:,} tokens · {len(report.rows)} configs simulated in {report.seconds:.2f} s "
                f"({total / max(report.seconds, 1e-9):,.0f} tokens/s)")
    for note in report.notes:
        st.caption(f"Note: {note}")
    df = pd.DataFrame([row_values(r) for r in report.rows], columns=list(COLUMNS))
    st.dataframe(df, hide_index=True, width="stretch", key="lab_table", column_config={
        "slot_util": st.column_config.NumberColumn("slot util", format="percent"),
        "hit_rate": st.column_config.NumberColumn("hit rate", format="percent")})
    st.download_button("Download CSV", to_csv(report), file_name="kvscope_lab.csv", mime="text/csv",
                       icon=":material/download:", key="lab_csv")
    charts = st.columns(3)
    for col, (field, title) in zip(charts, (("slot_util", "slot utilisation"), ("mean_entries", "block-table entries "
                                                                                                "(mean)"),
                                           ("peak_used", "peak blocks used"))):
        col.vega_lite_chart({"data": {"values": df[["config", field]].to_dict("records")}, "height": 160,
                             "title": title, "mark": {"type": "bar", "color": USED},
                             "encoding": {"y": {"field": "config", "type": "nominal", "sort": None, "title": None},
                                          "x": {"field": field, "type": "quantitative", "title": None}}},
                            width="stretch")
    st.markdown("**Each pool at its peak** (the end of the step with the most blocks in use)")
    cols = st.columns(min(3, len(report.rows)) or 1)
    for i, row in enumerate(report.rows):
        with cols[i % len(cols)]:
            st.caption(f"{row.config.label} · step {row.peak.step if row.peak else '-'} · {row.peak_used} used")
            st.image(grid_svg(row))


def grid_svg(row: LabRow, width: int = 360) -> str:
    """The pool at its peak, coloured by the grid's rule (`block_color`): a used or shared block
    filled by the tokens it holds, the others solid."""
    g = row.peak
    if g is None:
        return "<div>(no block was ever used)</div>"
    n, bs = len(g.states), row.config.pool.block_size
    per_row = max(8, min(64, int((n * 2) ** 0.5)))
    cell = max(3.0, width / per_row)
    rows = -(-n // per_row)
    parts = []
    for i, (state, tokens) in enumerate(zip(g.states, g.tokens)):
        x, y = (i % per_row) * cell, (i // per_row) * cell
        s = cell - 1
        color = block_color(state)
        if state not in (USED_STATE, SHARED):
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s:.1f}" height="{s:.1f}" fill="{color}"/>')
            continue
        fill = s * min(1.0, tokens / bs)
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s:.1f}" height="{s:.1f}" fill="{color}" opacity="0.35"/>'
                     f'<rect x="{x:.1f}" y="{y + s - fill:.1f}" width="{s:.1f}" height="{fill:.1f}" fill="{color}"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{per_row * cell:.0f}" height="{rows * cell:.0f}" '
            f'role="img" aria-label="pool at its peak">{"".join(parts)}</svg>')
