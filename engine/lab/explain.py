"""Why the prefix cache missed, for a recording: every missed token's reason, the requests that
missed most, each reuse an eviction came before, and what would have hit (docs/misses.md).

    kvscope-explain RECORDING.jsonl                # the table, the requests, the evictions, the what-ifs
    kvscope-explain RECORDING.jsonl --top 5 --no-what-if
    kvscope-explain RECORDING.jsonl --json         # the same as JSON, for scripts

The reasons come from the recording's events (kvscope_contract/misses.py); the what-ifs replay the
recording's requests through the lab (the real scheduler and block manager, no model) at its own
config and at the configs that would make more of it hit.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import msgspec

from engine.lab import report as lab
from engine.lab.workload import from_recording
from kvscope_contract.counters import hit_rate
from kvscope_contract.lab import what_if_lines
from kvscope_contract.misses import (REASONS, ExplainedPool, MissExplainer, by_request, evicted_cases,
                                     eviction_summary, reason_line)
from kvscope_contract.rebuild import with_rebuilt_prompts
from kvscope_contract.recording import Recording

REBUILT_NOTE = ("prompts rebuilt from block hashes (the recording has no prompt token ids): a prompt that "
                "parts from another inside a block shows as cold, not diverged")


def explain_recording(path: Path) -> tuple[MissExplainer, int, str]:
    """The recording's events folded through the explainer (keeping every admission), how many
    prompts were rebuilt from block hashes, and a note when the recording was cut short."""
    rec = Recording(path)
    events, rebuilt = with_rebuilt_prompts(rec.start, [ev for batch in rec.batches for ev in batch])
    pool = ExplainedPool.from_snapshot(rec.start, keep=None)
    for ev in events:
        if ev.seq > pool.last_event:
            pool.apply(ev)
    return pool.explainer, rebuilt, rec.cut_short


def _report(x: MissExplainer, top: int) -> dict:
    t = x.totals
    return {
        "admissions": t.admissions, "tokens": t.tokens, "looked_up": t.looked_up, "hit": t.hit,
        "first_admissions": {"looked_up": t.first_looked_up, "hit": t.first_hit},
        "missed": {r: t.by_reason.get(r, 0) for r in REASONS},
        "requests": [{"request_id": r.request_id, "tokens": r.tokens, "hit": r.hit,
                      "missed": dict(r.by_reason())} for r in by_request(x.admissions)[:top]],
        "evicted": [{"seq_id": a.seq_id, "admitted_at": a.event, "start": s.start, "end": s.end,
                     "evictions": [dataclasses.asdict(e) for e in s.evictions]}
                    for a, s in evicted_cases(x.admissions)[:top]],
    }


def print_report(name: str, x: MissExplainer, rebuilt: int, top: int, out=sys.stdout, cut_short: str = "") -> None:
    t = x.totals
    say = lambda s="": print(s, file=out)  # noqa: E731
    say(f"{name}: {t.admissions:,} admissions, {t.looked_up:,} tokens looked up in the prefix cache, "
        f"{t.hit:,} hit ({hit_rate(t.hit, t.looked_up):.1%})")
    if t.first_looked_up != t.looked_up:
        say(f"  vLLM's definition (first admissions only): {t.first_hit:,} of {t.first_looked_up:,} "
            f"({hit_rate(t.first_hit, t.first_looked_up):.1%}); re-admissions after a recompute are `recomputed` below")
    if rebuilt:
        say(f"  note: {rebuilt} {REBUILT_NOTE}")
    if cut_short:
        say(f"  note: {cut_short}")
    say()
    off = t.by_reason.get("caching_off", 0)
    say(f"why the other {t.missed:,} tokens missed"
        + (f" ({off:,} of them never looked up: prefix caching was off)" if off else "") + ":")
    width = max(map(len, REASONS))
    for r in REASONS:
        n = t.by_reason.get(r, 0)
        if n:
            say(f"  {r:<{width}}  {n:>9,}  {n / t.missed:6.1%}  {REASONS[r]}")
    say(f"  {'total':<{width}}  {sum(t.by_reason.values()):>9,}")
    reqs = [r for r in by_request(x.admissions) if r.missed][:top]
    if reqs:
        say()
        say("the requests that missed most:")
        for r in reqs:
            again = sum(a.readmission for a in r.admissions)
            say(f"  {r.request_id}: {r.tokens:,} looked up, {r.hit:,} hit"
                + (f" ({len(r.admissions)} admissions, {again} after preemption)" if len(r.admissions) > 1 else "")
                + f": {reason_line(r.by_reason())}")
    cases = evicted_cases(x.admissions)
    if cases:
        say()
        say("evicted before reuse (newest first):")
        for a, s in cases[:top]:
            say(f"  {a.seq_id} (admitted at event {a.event:,}, step {a.step}), tokens {s.start}-{s.end}: "
                + eviction_summary(s.evictions))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvscope-explain", description=__doc__.split("\n\n")[0],
                                 epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", type=Path, help="a recording (engine.serve.server --record, or the dashboard's)")
    ap.add_argument("--top", type=int, default=10, help="requests and evictions listed (default 10)")
    ap.add_argument("--no-what-if", action="store_true", help="skip the lab's replays")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        x, rebuilt, cut_short = explain_recording(args.recording)
    except (OSError, ValueError, msgspec.DecodeError) as e:
        print(f"kvscope-explain: {e}", file=sys.stderr)
        return 2
    what_ifs, notes = ([], []) if args.no_what_if else _what_ifs(args.recording)
    if args.json:
        doc = _report(x, args.top) | {"prompts_rebuilt": rebuilt, "cut_short": cut_short, "what_if": what_ifs,
                                      "what_if_notes": notes}
        sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
        return 0
    print_report(args.recording.name, x, rebuilt, args.top, cut_short=cut_short)
    if what_ifs:
        print()
        print("what would have hit (a replay of this recording's requests through the lab: the real scheduler "
              "and block manager, no model):")
        for line in what_ifs:
            print(f"  {line}")
        for note in notes:
            print(f"  note: {note}")
    return 0


def _what_ifs(path: Path) -> tuple[list[str], list[str]]:
    """The what-if lines, and the notes on how the lab read the recording."""
    workload = from_recording(path)
    if not workload.requests:
        return [], []
    report = lab.run(workload, lab.what_if_configs(lab.default_base(workload)))
    return what_if_lines(report), report.notes


if __name__ == "__main__":
    sys.exit(main())
