"""The picture of docs/perfetto.md: the dashboard replaying the demo recording, paused, beside
a drawing of the Perfetto trace its event log's button downloads at that moment (the same
history), decoded with the perfetto package's protobuf classes. The Perfetto UI itself needs
a network this script does not assume; the right half is drawn here from the decoded trace.

    python -m tools.shoot_perfetto [--out assets/perfetto.png] [--at 2300]
"""
from __future__ import annotations

import argparse
import html
import os
import re
import signal
from collections import defaultdict
from pathlib import Path

from tools.launch import CHROMIUM, FLAGS, ROOT, start_streamlit
from tools.shoot_docs import TOP

PHASE_COLOURS = {"waiting": "#9ca3af", "running": "#2563eb", "swapped out": "#f59e0b", "preempted": "#dc2626"}


def summary_html(data: bytes) -> str:
    """The decoded trace as a page: a row per sequence track with its phase slices over time, the
    instants' counts and the counters' last values."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    trace = Trace()
    trace.ParseFromString(data)
    names, parents, order = {}, {}, []
    slices, opened = defaultdict(list), {}
    instants: dict[str, int] = defaultdict(int)
    counters: dict[str, float] = {}
    t0 = t1 = None
    for pkt in trace.packet:
        if pkt.HasField("track_descriptor"):
            d = pkt.track_descriptor
            names[d.uuid], parents[d.uuid] = d.name, d.parent_uuid
            continue
        te, ts = pkt.track_event, pkt.timestamp / 1e9
        t0, t1 = ts if t0 is None else min(t0, ts), ts if t1 is None else max(t1, ts)
        if te.type == TrackEvent.TYPE_SLICE_BEGIN:
            if te.track_uuid not in slices:
                order.append(te.track_uuid)
            opened[te.track_uuid] = (te.name, ts)
        elif te.type == TrackEvent.TYPE_SLICE_END:
            name, start = opened.pop(te.track_uuid)
            slices[te.track_uuid].append((name, start, ts))
        elif te.type == TrackEvent.TYPE_INSTANT:
            instants[te.name.split(":")[0].split(" →")[0].split(" (")[0]] += 1
        elif te.type == TrackEvent.TYPE_COUNTER:
            value = te.counter_value if te.HasField("counter_value") else te.double_counter_value
            counters[names[te.track_uuid]] = value
    for uuid, (name, start) in opened.items():  # still open at the end of the history
        slices[uuid].append((name, start, t1))
    span, width, row = max((t1 or 0) - (t0 or 0), 1e-9), 560, 13
    rows = []
    for i, uuid in enumerate(order):
        y = i * row
        label = names[uuid] if names.get(parents.get(uuid)) == "requests" else "  ↳ " + names[uuid]
        rows.append(f'<text x="0" y="{y + 10}" font-size="10">{html.escape(label)}</text>')
        for name, a, b in slices[uuid]:
            x = 120 + (a - t0) / span * width
            rows.append(f'<rect x="{x:.1f}" y="{y + 1}" width="{max((b - a) / span * width, 1):.1f}" '
                        f'height="{row - 3}" '
                        f'fill="{PHASE_COLOURS.get(name, "#000")}"><title>{html.escape(name)}</title></rect>')
    legend = " ".join(f'<span style="background:{c};color:white;padding:0 4px">{n}</span>'
                      for n, c in PHASE_COLOURS.items())
    counts = "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in sorted(instants.items()))
    last = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.3g}</td></tr>" if isinstance(v, float) else
                   f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in counters.items())
    return f"""<html><body style="font-family:sans-serif;font-size:12px;margin:10px;width:700px">
<h3 style="margin:0 0 4px">The downloaded kvscope.pftrace, decoded ({len(data):,} bytes)</h3>
<div>{len(order)} sequence tracks, engine time {t0:.2f} s to {t1:.2f} s. Phases: {legend}</div>
<svg width="700" height="{len(order) * row + 4}">{''.join(rows)}</svg>
<table style="display:inline-block;vertical-align:top;margin-right:30px">
<tr><th align=left>instant</th><th>count</th></tr>{counts}</table>
<table style="display:inline-block;vertical-align:top">
<tr><th align=left>counter (last step)</th><th>value</th></tr>{last}</table>
<p style="color:#555">Drawn from the trace by tools/shoot_perfetto.py (not the Perfetto UI): the same tracks,
slices, instants and counters ui.perfetto.dev shows.</p></body></html>"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "perfetto.png")
    ap.add_argument("--at", type=int, default=2300, help="the demo's event to pause at (or just after)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    log = (tmp / "streamlit.log").open("w")
    app, url = start_streamlit(["--replay", str(ROOT / "assets" / "demo_recording.jsonl")], out=log)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1250}, accept_downloads=True)
            page.goto(url)
            page.wait_for_function("window.__kvscope_grid && window.__kvscope_grid.n > 0", timeout=240_000)
            # pause once the replay passes event --at (by default the load scenario, its swaps done)
            page.wait_for_function("at => { const m = document.body.innerText.match(/event ([\\d,]+) of/); "
                                   "return m && parseInt(m[1].replaceAll(',', '')) >= at; }", arg=args.at,
                                   timeout=240_000)
            side = page.get_by_test_id("stSidebar")
            side.get_by_role("button", name="Pause", exact=True).click()
            side.get_by_role("button", name="Resume", exact=True).wait_for(timeout=30_000)
            page.get_by_text("Event log", exact=True).click()
            page.get_by_role("button", name="Perfetto trace").click()
            button = page.get_by_role("button", name=re.compile("Download kvscope.pftrace"))
            button.wait_for(timeout=60_000)
            page.wait_for_timeout(3000)
            with page.expect_download(timeout=120_000) as dl:
                button.click()
            trace = tmp / "kvscope.pftrace"
            dl.value.save_as(trace)
            page.get_by_text("Timeline", exact=True).click()
            page.wait_for_timeout(3000)
            page.evaluate(TOP)
            page.screenshot(path=str(tmp / "dashboard.png"))
            right = browser.new_page(viewport={"width": 720, "height": 1250})
            right.set_content(summary_html(trace.read_bytes()))
            right.screenshot(path=str(tmp / "trace.png"), full_page=True)
            browser.close()
        from PIL import Image

        left, rimg = Image.open(tmp / "dashboard.png"), Image.open(tmp / "trace.png")
        out = Image.new("RGB", (left.width + rimg.width, max(left.height, rimg.height)), "white")
        out.paste(left, (0, 0))
        out.paste(rimg, (left.width, 0))
        out.save(args.out, optimize=True)
        print(f"wrote {args.out}")
    finally:
        os.killpg(app.pid, signal.SIGTERM)
        app.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
