"""The lab from the command line: one workload, several allocator configs, one table.

    python -m engine.lab mixed --block-sizes 4,8,16,32,64            # a preset: chat, parallel, mixed
    python -m engine.lab assets/demo_recording.jsonl --blocks 64,128,256 --preemption swap,recompute
    python -m engine.lab chat --scale 10 --caching on,off --csv out.csv --grid
    python -m engine.lab trace:conversation_trace.jsonl --policy lru,lfu,opt   # a trace's capacity sweep

Each axis given takes every value listed (the configs are all their combinations); the rest come
from the recording's pool (presets: 256 blocks of 16). A block size given without --blocks keeps
the pool's memory. No model runs: each sample's outputs are replayed, in seconds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from kvscope_contract.lab import encode_report, to_csv, what_if_lines
from engine.lab import report as lab, trace_sweep
from engine.lab.record import record
from engine.lab.workload import PRESETS, load


def _list(cast):
    def parse(text: str) -> list:
        try:
            return [cast(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _switch(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"{text!r}: say on or off")


def _mode(text: str) -> str:
    if text not in ("swap", "recompute"):
        raise ValueError(f"{text!r}: say swap or recompute")
    return text


def _window(text: str) -> int | None:
    if text.lower() in ("none", "full", "off"):
        return None
    if int(text) < 1:
        raise ValueError(f"{text!r}: a window is at least one token")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.lab", description=__doc__.split("\n\n")[0],
                                 epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", help=f"a preset ({', '.join(PRESETS)}), a recording (.jsonl), or trace:PATH "
                                     "(a request trace: see python -m engine.lab trace:PATH --help)")
    ap.add_argument("--scale", type=int, default=1, help="presets: repeat the mix this many times")
    ap.add_argument("--block-sizes", type=_list(int), default=[], metavar="B,...")
    ap.add_argument("--blocks", type=_list(int), default=[], metavar="N,...", help="device blocks")
    ap.add_argument("--host-blocks", type=_list(int), default=[], metavar="N,...")
    ap.add_argument("--caching", type=_list(_switch), default=[], metavar="on,off", help="prefix caching")
    ap.add_argument("--preemption", type=_list(_mode), default=[], metavar="swap,recompute")
    ap.add_argument("--window", type=_list(_window), default=[], metavar="W,...|none",
                    help="a hybrid pool of Gemma 3's shape (5 sliding-window groups of W tokens, 1 full); "
                         "none: full attention")
    ap.add_argument("--watermark", type=_list(float), default=[], metavar="F,...",
                    help="fraction of device blocks kept free when admitting (default 0.01)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--what-if", action="store_true",
                    help="the workload's own config, then what would make more of it hit (twice the blocks, half "
                         "the block size at the same memory, or prefix caching on): docs/misses.md")
    ap.add_argument("--stepwise", action="store_true", help="run every step in full (slower; same numbers)")
    ap.add_argument("--csv", type=Path, help="also write the table as CSV")
    ap.add_argument("--json", action="store_true", help="print the report as JSON (with the peak grids)")
    ap.add_argument("--grid", action="store_true", help="draw each config's pool at its peak")
    ap.add_argument("--record", type=Path, metavar="FILE",
                    help="also write the first config's run as a recording the dashboard can replay")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("trace:"):  # a request trace: hit rate against capacity (docs/traces.md)
        return trace_sweep.main(argv)
    args = ap.parse_args(argv)
    try:
        workload = load(args.workload, args.scale)
    except (OSError, ValueError, msgspec.DecodeError) as e:
        print(f"engine.lab: {e}", file=sys.stderr)
        return 2
    base = lab.default_base(workload)
    if args.max_num_seqs:
        base.pool = msgspec.structs.replace(base.pool, max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        base.max_num_batched_tokens = args.max_num_batched_tokens
    bad = [b for b in args.block_sizes if b < 1 or b & (b - 1)] + [n for n in args.blocks if n < 1]
    if bad:
        print(f"engine.lab: block sizes must be powers of two and block counts positive, got {bad}", file=sys.stderr)
        return 2
    cfgs = (lab.what_if_configs(base) if args.what_if else
            lab.configs(base, args.block_sizes, args.blocks, args.caching, args.preemption, args.watermark,
                        args.host_blocks, args.window))
    report = lab.run(workload, cfgs, fast=not args.stepwise)
    if args.record:
        n = record(cfgs[0], workload, args.record)
        print(f"recorded {n:,} events of {cfgs[0].label} to {args.record}", file=sys.stderr)
    if args.csv:
        args.csv.write_text(to_csv(report))
    if args.json:
        sys.stdout.write(encode_report(report).decode() + "\n")
        return 0
    print(f"{report.workload}: {report.requests} requests, {report.sequences} sequences, "
          f"{report.workload_tokens:,} tokens")
    for note in report.notes:
        print(f"  note: {note}")
    print()
    print(lab.format_table(report))
    if args.what_if:
        print("\nwhat would have hit (the prefix cache's hit tokens against the first row):")
        print("\n".join(f"  {line}" for line in what_if_lines(report)))
    for row in report.rows:
        if row.rejected:
            print(f"  {row.config.label}: {len(row.rejected)} requests never fit "
                  f"({', '.join(row.rejected[:5])}{'…' if len(row.rejected) > 5 else ''})")
    if args.grid:
        for row in report.rows:
            print(f"\n{row.config.label} at its peak, step {row.peak.step if row.peak else '-'} "
                  f"(. free  c cached  # used  + partly filled  S shared):")
            print(lab.ascii_grid(row))
    total = report.workload_tokens * len(report.rows)
    print(f"\nsimulated {total:,} workload tokens in {report.seconds:.2f} s = "
          f"{total / max(report.seconds, 1e-9):,.0f} tokens/s ({len(report.rows)} configs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
