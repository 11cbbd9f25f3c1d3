"""Hit rate against pool capacity, per eviction policy, on a request trace: the replays, the
table, and the models whose KV bytes per token turn blocks into bytes.

    python -m engine.lab trace:conversation_trace.jsonl --policy lru,lfu,opt --requests 2000
    python -m engine.lab trace:my.jsonl --sweep 1000,4000,16000 --one-at-a-time --model smollm2
    python -m engine.lab trace:my.jsonl --bytes-per-token 327680 --csv sweep.csv --json > sweep.json
    python -m engine.lab trace:conversation_trace.jsonl --sweep 500,2000 --host-blocks 0,8000

`sweep()` is the API (the dashboard runs this module as a subprocess with --json and decodes
`kvscope_contract.lab.TraceSweep`). The trace is read and checked once before any replay (a bad
line stops it with its line number, nothing run); each point replays the file through the real
scheduler and block manager (engine/lab/trace_replay.py).
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from pathlib import Path
from typing import Callable

from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import bytes_per_block
from kvscope_contract.lab import TRACE_REASONS, LabConfig, TracePoint, TraceSweep, encode_sweep
from engine.core.eviction import load_policy, policy_name
from engine.lab.trace import TRACE_BLOCK, TraceError, TraceIndex, scan
from engine.lab.trace_replay import TraceLab

# (layers, KV heads, head dim, bytes per element) of the bundled models, from their configs
MODELS: dict[str, tuple[str, int, int, int, int]] = {
    "smollm2": ("SmolLM2-135M", 30, 3, 64, 2),    # 23,040 B/token in bf16
    "gemma3": ("Gemma 3 270M", 18, 1, 256, 2),    # 18,432 B/token in bf16, every layer's K/V
}
STEP_MS = 50.0        # one engine step: ~20 decode tokens/s per sequence, a usual time between tokens
BATCH_TOKENS = 8192   # tokens per step (vLLM's max_num_batched_tokens for large GPUs)
MAX_SEQS = 256        # vLLM's max_num_seqs
POINTS = 12


def model_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token, in bytes."""
    _, layers, heads, dim, itemsize = MODELS[model]
    return bytes_per_block(1, [], layers, heads, dim, itemsize)


def default_capacities(index: TraceIndex, watermark: float = 0.01, points: int = POINTS) -> list[int]:
    """`points` pool sizes in blocks, log-spaced from ~1/300 of a pool that never evicts (but
    at least twice the longest request) up to that pool."""
    top = unlimited_blocks(index, watermark)
    lo = min(top, max(2 * index.largest_request + 2, top // 300))
    if points < 2 or lo == top:
        return [top]
    ratio = (top / lo) ** (1 / (points - 1))
    return sorted({round(lo * ratio ** k) for k in range(points - 1)} | {top})


def unlimited_blocks(index: TraceIndex, watermark: float = 0.01) -> int:
    """A pool that never evicts on this trace: every block any request takes, above the watermark."""
    return int(index.blocks_needed / (1 - watermark)) + 2


def lab_config(blocks: int, block_size: int, max_num_batched_tokens: int = BATCH_TOKENS,
               max_num_seqs: int = MAX_SEQS, watermark: float = 0.01, host_blocks: int = 0) -> LabConfig:
    """The replay's engine: recompute preemption and no swap pool (vLLM v1's), prefix caching on,
    a host tier of `host_blocks` (docs/offload.md)."""
    pool = p.PoolConfig(block_size=block_size, num_device_blocks=blocks, num_host_blocks=0,
                        preemption_mode="recompute", max_num_seqs=max_num_seqs, num_offload_blocks=host_blocks)
    return LabConfig(pool=pool, watermark=watermark, max_num_batched_tokens=max_num_batched_tokens)


def replay(index: TraceIndex, blocks: int, policy: str, *, step_ms: float = STEP_MS, one_at_a_time: bool = False,
           max_num_batched_tokens: int = BATCH_TOKENS, max_num_seqs: int = MAX_SEQS, watermark: float = 0.01,
           bytes_per_token: int | None = None, host_blocks: int = 0,
           long_prefill_token_threshold: int = 0) -> TracePoint:
    """One point: the trace (as far as `index` read it) through a pool of `blocks` under `policy`,
    with a host tier of `host_blocks`."""
    t0 = time.perf_counter()
    cfg = lab_config(blocks, index.block_size, max_num_batched_tokens, max_num_seqs, watermark, host_blocks)
    lab = TraceLab(cfg, index, load_policy(policy)(), step_ms=step_ms, one_at_a_time=one_at_a_time,
                   limit=index.requests, long_prefill_token_threshold=long_prefill_token_threshold)
    row = lab.run()
    m = lab.meter
    tokens = blocks * index.block_size
    return TracePoint(policy=policy_name(policy), blocks=blocks, tokens=tokens,
                      bytes=None if bytes_per_token is None else tokens * bytes_per_token,
                      hit_tokens=row.hit_tokens, looked_up_tokens=row.looked_up_tokens,
                      missed={r: m.missed.get(r, 0) for r in TRACE_REASONS}, evictions=m.evictions,
                      preemptions=row.preemptions, rejected=len(row.rejected), finished=row.finished,
                      steps=row.steps, seconds=time.perf_counter() - t0, host_blocks=host_blocks,
                      host_hit_tokens=row.host_hit_tokens)


def sweep(path: Path | str, capacities: list[int] | None = None, policies: list[str] = ("lru",), *,
          block_size: int = TRACE_BLOCK, requests: int | None = None, one_at_a_time: bool = False,
          step_ms: float = STEP_MS, max_num_batched_tokens: int = BATCH_TOKENS, max_num_seqs: int = MAX_SEQS,
          watermark: float = 0.01, model: str | None = None, bytes_per_token: int | None = None,
          long_prefill_token_threshold: int = 0, progress: Callable[[TracePoint], None] | None = None,
          host_blocks: list[int] = (0,)) -> TraceSweep:
    """Replay the trace's first `requests` (None: all) at each capacity (blocks; None: the
    default log-spaced points) under each policy (a name, or `module:Class`), with each host tier
    size of `host_blocks` (0: device only).
    `long_prefill_token_threshold`: a prefill's most tokens a step (vLLM's; 0: none), so requests are
    admitted while a long prompt still prefills (the `in_flight` misses: docs/traces.md).

    Raises:
        TraceError: a bad line or block size, before anything runs.
        ValueError: an unknown policy or model, before anything runs.
    """
    t0 = time.perf_counter()
    for spec in policies:
        load_policy(spec)
    if model is not None:
        if model not in MODELS:
            raise ValueError(f"model {model!r}: say one of {', '.join(MODELS)}, or give --bytes-per-token")
        bytes_per_token = bytes_per_token or model_bytes_per_token(model)
    index = scan(path, block_size, requests)
    if not index.requests:
        raise TraceError(f"{path}: no requests")
    capacities = capacities or default_capacities(index, watermark)
    out = TraceSweep(trace=str(path), requests=index.requests, prompt_tokens=index.prompt_tokens,
                     output_tokens=index.output_tokens, block_size=block_size, one_at_a_time=one_at_a_time,
                     step_ms=step_ms, max_num_batched_tokens=max_num_batched_tokens,
                     long_prefill_token_threshold=long_prefill_token_threshold,
                     model=MODELS[model][0] if model else None, bytes_per_token=bytes_per_token,
                     ceiling_hit_tokens=index.ceiling_hit_tokens, unlimited_blocks=unlimited_blocks(index, watermark))
    for blocks in capacities:
        for spec in policies:
            for host in host_blocks:
                point = replay(index, blocks, spec, step_ms=step_ms, one_at_a_time=one_at_a_time,
                               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                               watermark=watermark, bytes_per_token=bytes_per_token, host_blocks=host,
                               long_prefill_token_threshold=long_prefill_token_threshold)
                out.points.append(point)
                if progress:
                    progress(point)
    out.seconds = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------ the table
COLUMNS = ("policy", "blocks", "tokens", "bytes", "hit_rate", "of_ceiling", *TRACE_REASONS, "evictions",
           "preemptions", "rejected", "seconds", "host_blocks", "host_hit", "with_host")


def point_values(s: TraceSweep, pt: TracePoint) -> dict:
    """One point as the table and the CSV show it: the reasons as shares of the tokens looked up."""
    look = max(1, pt.looked_up_tokens)
    return dict(zip(COLUMNS, (
        pt.policy, pt.blocks, pt.tokens, pt.bytes, round(pt.hit_rate, 4),
        round(pt.hit_rate / s.ceiling, 4) if s.ceiling else None,
        *(round(pt.missed.get(r, 0) / look, 4) for r in TRACE_REASONS), pt.evictions, pt.preemptions,
        pt.rejected, round(pt.seconds, 2), pt.host_blocks, round(pt.host_hit_tokens / look, 4),
        round(pt.tier_hit_rate, 4))))


def to_csv(s: TraceSweep) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    w.writeheader()
    for pt in s.points:
        w.writerow(point_values(s, pt))
    return out.getvalue()


def _size(n: float, units=("", "K", "M", "G", "T"), step=1000.0) -> str:
    for u in units:
        if abs(n) < step or u == units[-1]:
            return f"{n:,.0f}{u}" if not u or n >= 100 else f"{n:.3g}{u}"
        n /= step
    return str(n)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def format_table(s: TraceSweep) -> str:
    tiers = any(pt.host_blocks for pt in s.points)  # the host tier's columns, where one ran
    heads = ["policy", "blocks", "tokens", "bytes", "hit rate", "of ceiling", "cold", "evicted", "in flight",
             "partial", "recomp", "evictions", "preempt", "rejected", "s"] + (
             ["host tier", "host hit", "with host"] if tiers else [])
    rows = []
    for pt in s.points:
        v = point_values(s, pt)
        rows.append([pt.policy, f"{pt.blocks:,}", _size(pt.tokens), _bytes(pt.bytes), f"{pt.hit_rate:.1%}",
                     "-" if v["of_ceiling"] is None else f"{v['of_ceiling']:.0%}",
                     *(f"{v[r]:.1%}" for r in TRACE_REASONS), f"{pt.evictions:,}", f"{pt.preemptions:,}",
                     f"{pt.rejected:,}", f"{pt.seconds:.1f}"]
                    + ([f"{pt.host_blocks:,}", f"{v['host_hit']:.1%}", f"{pt.tier_hit_rate:.1%}"] if tiers else []))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
    line = lambda xs: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(xs, widths)))  # noqa: E731
    return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(r) for r in rows])


def describe(s: TraceSweep) -> str:
    mode = ("one request at a time" if s.one_at_a_time else
            f"arrivals at their timestamps, one engine step = {s.step_ms:g} ms of up to "
            f"{s.max_num_batched_tokens:,} tokens")
    size = f"; bytes: {s.model or 'given'} at {s.bytes_per_token:,} B/token" if s.bytes_per_token else ""
    return (f"{s.trace}: {s.requests:,} requests, {s.prompt_tokens:,} prompt tokens, {s.output_tokens:,} output "
            f"tokens; blocks of {s.block_size}; {mode}{size}\n"
            f"ceiling (an unlimited pool, one request at a time: every leading block an earlier prompt held, "
            f"never a prompt's last token): {s.ceiling_hit_tokens:,} tokens = {s.ceiling:.1%}; a pool of "
            f"{s.unlimited_blocks:,} blocks never evicts\n"
            f"misses as shares of the tokens looked up: cold (never cached), evicted (cached before), in flight "
            f"(a running request was still computing it), partial (the block of the prompt's last token), "
            f"recomp (re-admissions after a recompute preemption)"
            + ("; host hit: the tokens the device missed and the host tier served (loaded, not recomputed); "
               "with host: the device's hit rate and the host tier's together" if any(
                   pt.host_blocks for pt in s.points) else ""))


# ------------------------------------------------------------------------------ the command line
def _ints(text: str, least: int = 1, what: str = "capacities are positive numbers of blocks") -> list[int]:
    try:
        out = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if any(n < least for n in out):
        raise argparse.ArgumentTypeError(what)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.lab trace:PATH", description=__doc__.split("\n\n")[0],
                                 epilog="\n".join(__doc__.splitlines()[2:6]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="trace:PATH, a JSONL trace in the Mooncake format (docs/traces.md)")
    ap.add_argument("--sweep", type=_ints, default=None, metavar="N,...",
                    help=f"pool capacities in blocks (default: {POINTS} log-spaced up to a pool that never evicts)")
    ap.add_argument("--policy", default="lru", metavar="P,...",
                    help="eviction policies: lru, lfu, opt, or module.path:Class (default lru)")
    ap.add_argument("--block-size", type=int, default=TRACE_BLOCK,
                    help="tokens per block, a divisor of 512 (default 512)")
    ap.add_argument("--requests", type=int, default=None, metavar="N", help="replay the first N requests only")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="admit each request once the one before finished (a plain cache simulation)")
    ap.add_argument("--step-ms", type=float, default=STEP_MS,
                    help="wall time of one engine step: a request at t ms arrives after step t / step-ms "
                         f"(default {STEP_MS:g})")
    ap.add_argument("--max-num-batched-tokens", type=int, default=BATCH_TOKENS,
                    help=f"tokens one step computes (default {BATCH_TOKENS})")
    ap.add_argument("--max-num-seqs", type=int, default=MAX_SEQS,
                    help=f"running sequences at most (default {MAX_SEQS})")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                    help="a prefill's most tokens a step (vLLM's; 0: no cap): others are admitted meanwhile")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="show capacity in this model's KV bytes")
    ap.add_argument("--bytes-per-token", type=int, default=None,
                    help="KV bytes per token of a model given by numbers (the Mooncake paper's: 327680)")
    ap.add_argument("--host-blocks", default=[0], metavar="N,...",
                    type=lambda t: _ints(t, 0, "host tier sizes are numbers of blocks, 0 or more"),
                    help="host tier sizes in blocks, each replayed at every capacity (0: device only; "
                         "docs/offload.md). Default 0")
    ap.add_argument("--csv", type=Path, help="also write the table as CSV")
    ap.add_argument("--json", action="store_true", help="print the sweep as JSON (kvscope_contract.lab.TraceSweep)")
    args = ap.parse_args(argv)
    path = args.trace.removeprefix("trace:")
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]

    def progress(pt: TracePoint) -> None:
        host = f", with {pt.host_blocks:,} in the host tier {pt.tier_hit_rate:.1%}" if pt.host_blocks else ""
        print(f"  {pt.policy} at {pt.blocks:,} blocks: hit rate {pt.hit_rate:.1%}{host} ({pt.seconds:.1f} s)",
              file=sys.stderr)

    try:
        s = sweep(path, args.sweep, policies, block_size=args.block_size, requests=args.requests,
                  one_at_a_time=args.one_at_a_time, step_ms=args.step_ms,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  model=args.model, bytes_per_token=args.bytes_per_token, progress=progress,
                  host_blocks=args.host_blocks or [0], long_prefill_token_threshold=args.long_prefill_token_threshold)
    except (OSError, ValueError) as e:
        print(f"engine.lab: {e}", file=sys.stderr)
        return 2
    if args.csv:
        args.csv.write_text(to_csv(s))
    if args.json:
        sys.stdout.write(encode_sweep(s).decode() + "\n")
        return 0
    print(describe(s))
    print()
    print(format_table(s))
    print(f"\n{len(s.points)} replays in {s.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
