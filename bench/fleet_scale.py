"""A fleet at scale: N KVScope engines of 32,768 blocks each (an 80 GB GPU's pool for an 8B
model) on the dashboard's fleet page, in a real browser.

Engines: `python -m engine.synthetic` (the real engine core and server, random tokens), several
pools per process (`--engines`, each its own engine core, thread, port and server), plus two
processes of one engine each: the victims of the stall test. Started once, for the largest N;
each N gets a fresh dashboard (`--fleet` file of the first N engines) and a fresh Chromium.

Per N, over `--seconds`:
- redraws/s of the fleet page in Chromium: the cards carry the page's redraw number
  (`data-drawn`); a script in the page samples the last card's every 50 ms, so a redraw counts
  once the whole page of cards has reached the browser. Also the server's fragment runs/s.
- the dashboard's RSS once every card is live, ten times over the run and at the end (a line
  fitted over N: MiB per engine), and its CPU share.
At the largest N, the stall test: SIGSTOP one victim and SIGKILL the other, then for
`--stall-seconds` read every card: when each victim is marked (stalled / down), and the largest
"last event" age of every other engine, against the same window before.

    python -m bench.fleet_scale [--sizes 8,16,32,64] [--blocks 32768] [--seconds 30] [--rounds 1]

Prints a table (markdown) to paste into docs/benchmarks.md with the machine's load.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from app.link.launcher import ServerProcess
from tools.launch import CHROMIUM, FLAGS, start_streamlit

ROOT = Path(__file__).resolve().parent.parent

# every card: name -> [state, "last event" text, data-drawn]
CARDS_JS = """() => Object.fromEntries([...document.querySelectorAll('[data-engine]')].map(e => {
  const k = [...e.querySelectorAll('.nums span')].findIndex(s => s.textContent === 'last event');
  return [e.dataset.engine, [e.querySelector('.st')?.textContent, e.querySelectorAll('.nums b')[k]?.textContent,
                             +e.dataset.drawn]];
}))"""
# samples the last card's redraw number every 50 ms: [[ms, drawn], ...] in window.__draws
SAMPLER_JS = """() => { window.__draws = []; window.__sampler = setInterval(() => {
  const cards = document.querySelectorAll('[data-engine]');
  const d = cards.length ? +cards[cards.length - 1].dataset.drawn : 0;
  const w = window.__draws; if (!w.length || w[w.length - 1][1] !== d) w.push([performance.now(), d]);
}, 50); }"""


def age_s(text: str | None) -> float | None:
    m = re.match(r"([\d.]+) s ago", text or "")
    return float(m.group(1)) if m else None


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """median (min–max)"""
    if not xs:
        return "–"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ the engines
def engine_args(args, engines: int) -> list[str]:
    return ["--port", "0", "--engines", str(engines), "--num-device-blocks", str(args.blocks), "--num-host-blocks", "0",
            "--live", str(args.live), "--max-num-seqs", str(args.live), "--prompt-tokens", str(args.prompt_tokens),
            "--max-tokens", str(args.max_tokens), "--fill", str(args.fill), "--warm-steps", str(args.warm_steps),
            "--step-delay-ms", str(args.step_delay_ms)]


def start_engines(args, n: int) -> tuple[list[ServerProcess], list[str]]:
    """Two single-engine processes (the victims, first in the list) and n - 2 engines in
    processes of up to --per-process each; (processes, urls in fleet order)."""
    sizes = [1, 1] + [min(args.per_process, n - 2 - i) for i in range(0, max(n - 2, 0), args.per_process)]
    procs = [ServerProcess("engine.synthetic", engine_args(args, k)).start() for k in sizes]
    urls: list[list[str]] = [[] for _ in procs]
    deadline = time.monotonic() + args.start_timeout
    while any(len(u) < k for u, k in zip(urls, sizes)):
        for i, (proc, k) in enumerate(zip(procs, sizes)):
            if proc.returncode is not None:
                sys.exit(f"an engine process exited: {proc.exit_reason()}\n" + "\n".join(proc.tail(20)))
            urls[i] = proc.urls
        if time.monotonic() > deadline:
            sys.exit(f"engines not ready after {args.start_timeout} s: {[len(u) for u in urls]} of {sizes}")
        time.sleep(0.5)
    return procs, [u for us in urls for u in us]


def fleet_file(urls: list[str], directory: Path, n: int) -> Path:
    path = directory / f"fleet{n}.toml"
    path.write_text("".join(f'[[engine]]\nname = "e{i:02d}"\nurl = "{u}"\n' for i, u in enumerate(urls[:n])))
    return path


# ------------------------------------------------------------------------------ one dashboard
def measure(args, urls: list[str], n: int, directory: Path, procs: list[ServerProcess] | None) -> dict:
    """A fresh dashboard on the first n engines in a fresh Chromium: redraws, memory, CPU; with
    `procs` (the largest N), the stall test after."""
    from playwright.sync_api import sync_playwright

    out: dict = {"n": n}
    log = (directory / f"streamlit{n}.log").open("w")
    streamlit, url = start_streamlit(["--fleet", str(fleet_file(urls, directory, n))], out=log)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            page.set_default_timeout(args.start_timeout * 1000)
            t0 = time.monotonic()
            page.goto(url)
            page.wait_for_function("(n) => document.querySelectorAll('[data-engine] .st.live').length >= n", arg=n,
                                   timeout=args.start_timeout * 1000, polling=500)
            out["all_live_s"] = time.monotonic() - t0
            time.sleep(3)  # the first snapshots digested
            out["rss_live_mib"] = rss_mib(streamlit.pid)
            cards0 = page.evaluate(CARDS_JS)
            page.evaluate(SAMPLER_JS)
            cpu0, wall0, load0 = cpu_s(streamlit.pid), time.monotonic(), os.getloadavg()[0]
            ages: dict[str, list[float]] = {}
            out["rss_trace"] = [(0.0, out["rss_live_mib"])]  # (s, MiB): does it level off?
            while (now := time.monotonic() - wall0) < args.seconds:  # the others' ages, the stall test's baseline
                for name, (_, text, _) in page.evaluate(CARDS_JS).items():
                    if (a := age_s(text)) is not None:
                        ages.setdefault(name, []).append(a)
                if now - out["rss_trace"][-1][0] >= args.seconds / 10:
                    out["rss_trace"].append((round(now), rss_mib(streamlit.pid)))
                time.sleep(0.25)
            wall = time.monotonic() - wall0
            cards1 = page.evaluate(CARDS_JS)
            draws = page.evaluate("window.__draws")
            out["cpu_share"] = (cpu_s(streamlit.pid) - cpu0) / wall
            out["load"] = (load0, os.getloadavg()[0])
            out["rss_end_mib"] = rss_mib(streamlit.pid)
            last = list(cards0)[-1]
            out["runs_per_s"] = (cards1[last][2] - cards0[last][2]) / wall
            out["redraws_per_s"] = (len(draws) - 1) / ((draws[-1][0] - draws[0][0]) / 1000) if len(draws) > 1 else 0.0
            gaps = np.diff([d[0] for d in draws]) / 1000
            out["redraw_gap_p50_s"] = float(np.median(gaps)) if len(gaps) else float("nan")
            out["redraw_gap_max_s"] = float(gaps.max()) if len(gaps) else float("nan")
            out["age_max_s"] = max((max(a) for a in ages.values()), default=float("nan"))
            if procs is not None:
                out.update(stall(args, page, procs))
            browser.close()
    finally:
        streamlit.send_signal(signal.SIGTERM)
        streamlit.wait(timeout=30)
        log.close()
    return out


def stall(args, page, procs: list[ServerProcess]) -> dict:
    """SIGSTOP victim e00, SIGKILL victim e01; for --stall-seconds: when each is marked, and the
    others' largest last-event age."""
    stopped, killed = procs[0], procs[1]
    before = {name: age_s(text) for name, (_, text, _) in page.evaluate(CARDS_JS).items()}
    t0 = time.monotonic()
    os.kill(stopped.pid, signal.SIGSTOP)
    os.kill(killed.pid, signal.SIGKILL)
    marked: dict[str, tuple[float, str]] = {}  # victim -> (seconds after the signal, the state it was first shown in)
    others_max, drawn = 0.0, []
    try:
        while time.monotonic() - t0 < args.stall_seconds:
            cards = page.evaluate(CARDS_JS)
            now = time.monotonic() - t0
            for name, want in (("e00", ("stalled", "down")), ("e01", ("down",))):
                if name not in marked and (state := cards.get(name, [None])[0]) in want:
                    marked[name] = (now, state)
            ages = [a for name, (_, text, _) in cards.items()
                    if name not in ("e00", "e01") and (a := age_s(text)) is not None]
            others_max = max([others_max, *ages])
            drawn.append((now, max(d for _, _, d in cards.values())))
            time.sleep(0.25)
        state = {name: page.evaluate(CARDS_JS)[name][0] for name in ("e00", "e01")}
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    redraws = (drawn[-1][1] - drawn[0][1]) / (drawn[-1][0] - drawn[0][0]) if len(drawn) > 1 else 0.0
    others_before = [a for n, a in before.items() if n not in ("e00", "e01") and a is not None]
    return {"stopped_marked": marked.get("e00"), "killed_marked": marked.get("e01"), "victims_end": state,
            "others_age_max_during_s": others_max, "others_age_before_s": max(others_before, default=None),
            "runs_per_s_during": redraws}


# ------------------------------------------------------------------------------ report
def report(args, results: list[dict], engines_rss: float) -> str:
    sizes = sorted({r["n"] for r in results})
    by = {n: [r for r in results if r["n"] == n] for n in sizes}
    lines = [f"`python -m bench.fleet_scale --sizes {','.join(map(str, args.sizes))} --blocks {args.blocks} "
             f"--seconds {args.seconds:g} --rounds {args.rounds}` (engines: --live {args.live} --step-delay-ms "
             f"{args.step_delay_ms:g} --fill {args.fill:g}, {args.per_process} per process; {os.cpu_count()} CPUs)", "",
             "| engines | redraws/s in Chromium | fragment runs/s | gap between redraws p50 / max (s) | dashboard RSS, "
             "all live (MiB) "
             "| RSS at the end (MiB) | dashboard CPU (cores) | load avg (1 min) | largest last-event age (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        rs = by[n]
        lines.append(f"| {n} | {spread([r['redraws_per_s'] for r in rs])} | {spread([r['runs_per_s'] for r in rs])} | "
                     f"{spread([r['redraw_gap_p50_s'] for r in rs])} / {spread([r['redraw_gap_max_s'] for r in rs])} | "
                     f"{spread([r['rss_live_mib'] for r in rs], '{:.0f}')} | "
                     f"{spread([r['rss_end_mib'] for r in rs], '{:.0f}')} | "
                     f"{spread([r['cpu_share'] for r in rs])} | {spread([r['load'][1] for r in rs], '{:.1f}')} | "
                     f"{spread([r['age_max_s'] for r in rs], '{:.1f}')} |")
    if len(sizes) > 1:
        xs = [r["n"] for r in results]
        for key, what in (("rss_live_mib", "all live"), ("rss_end_mib", "at the end")):
            slope, base = np.polyfit(xs, [r[key] for r in results], 1)
            fit = np.poly1d((slope, base))
            worst = max(abs(r[key] - fit(r["n"])) for r in results)
            lines.append(f"\nDashboard RSS {what}: {base:.0f} MiB + {slope:.1f} MiB per engine "
                         f"(largest residual {worst:.0f} MiB).")
    lines.append(f"The engines' processes together: {engines_rss:,.0f} MiB RSS.")
    for r in results:
        lines.append(f"\nDashboard RSS over the run at {r['n']} engines (s: MiB): "
                     + ", ".join(f"{t:.0f}: {m:.0f}" for t, m in r["rss_trace"]))
    for r in results:
        if "stopped_marked" in r:
            f = lambda x: "never marked" if x is None else f"marked {x[1]} after {x[0]:.1f} s"
            lines.append(f"\nStall test at {r['n']} engines: the SIGSTOPped engine {f(r['stopped_marked'])} "
                         f"({r['victims_end']['e00']} at the end), the SIGKILLed one {f(r['killed_marked'])}; the "
                         f"other {r['n'] - 2} engines' largest last-event age {r['others_age_max_during_s']:.1f} s "
                         f"during "
                         f"{args.stall_seconds:g} s of it (at most {r['age_max_s']:.1f} s in the {args.seconds:g} s "
                         f"before); fragment runs/s meanwhile {r['runs_per_s_during']:.2f}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    ap.add_argument("--blocks", type=int, default=32768)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--stall-seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1, help="each size this many times, in alternating order")
    ap.add_argument("--per-process", type=int, default=16, help="engines served by one engine process")
    ap.add_argument("--live", type=int, default=4, help="requests kept in each engine")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fill", type=float, default=0.25)
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--step-delay-ms", type=float, default=500.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    if not os.access(CHROMIUM, os.X_OK):
        sys.exit(f"{CHROMIUM} is missing: apt-get install -y chromium")
    t0 = time.monotonic()
    procs, urls = start_engines(args, max(args.sizes))
    print(f"{len(urls)} engines of {args.blocks:,} blocks ready in {time.monotonic() - t0:.0f} s", flush=True)
    engines_rss = sum(rss_mib(p.pid) for p in procs)
    # A B A B: rounds alternate up and down, the last one up, so the largest N comes last (its stall test)
    order = [n for r in range(args.rounds) for n in (args.sizes if (args.rounds - r) % 2 else args.sizes[::-1])]
    results = []
    try:
        with tempfile.TemporaryDirectory() as d:
            for i, n in enumerate(order):
                r = measure(args, urls, n, Path(d), procs if i == len(order) - 1 else None)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                results.append(r)
    finally:
        for p in procs:
            p.stop()
    print(report(args, results, engines_rss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
