"""What the lab reports: one workload run under several allocator configs, side by side.

`python -m engine.lab ... --json` prints a `LabReport`; the dashboard's Lab view reads it (the
dashboard reaches the engine only through this contract) and both export the same CSV.
"""
from __future__ import annotations

import csv
import io

import msgspec
from msgspec import Struct

from kvscope_contract import counters
from kvscope_contract.protocol import PoolConfig


# the workloads `python -m engine.lab` builds by name (engine/lab/workload.py), and what each is
PRESETS = {"mixed": "Long and short mixed", "chat": "Chat with shared system prompts",
           "parallel": "Parallel sampling (n=4)"}


class LabConfig(Struct, kw_only=True):
    """One allocator configuration: the pool, plus the engine knobs that steer the allocator."""
    pool: PoolConfig
    watermark: float = 0.01             # fraction of device blocks kept free when admitting
    max_num_batched_tokens: int = 1024  # tokens per step; longer prompts are prefilled in chunks

    @property
    def label(self) -> str:
        p = self.pool
        windows = sorted({g.sliding_window for g in p.kv_groups if g.window is not None})
        return (f"{p.num_device_blocks}×{p.block_size}"
                + (f" {len(p.kv_groups)} groups, window {'/'.join(map(str, windows))}" if windows else "")
                + f"{'' if p.enable_prefix_caching else ' no-cache'} {p.preemption_mode}"
                + (f" wm {self.watermark:g}" if self.watermark != 0.01 else ""))


class PeakGrid(Struct, kw_only=True):
    """The device pool at the end of the step where the most blocks were in use."""
    step: int
    states: list[int]  # per block: 0 free, 1 cached, 2 used, 3 shared (kvscope_contract.state)
    tokens: list[int]  # tokens held per block (PoolState.block_tokens)


class LabRow(Struct, kw_only=True):
    config: LabConfig
    steps: int                  # engine steps the workload took
    peak_used: int              # most device blocks held at the end of a step
    mean_used: float            # device blocks held, averaged over steps
    slot_util: float            # tokens held / slots of held blocks, over all steps (internal fragmentation)
    hit_tokens: int             # prompt tokens served by the prefix cache
    looked_up_tokens: int       # tokens looked up in the cache at every admission (re-admissions too)
    preemptions: int
    recomputes: int             # preemptions by recompute (the rest swapped)
    swap_outs: int
    swap_ins: int
    swapped_blocks: int         # blocks copied between the pools, both ways: what swapping costs
    computed_tokens: int        # tokens run through the model, recomputed ones included: what recompute costs
    peak_entries: int           # most block-table entries held at once (all sequences)
    mean_entries: float
    finished: int               # sequences that ran to the end
    rejected: list[str] = []    # requests this pool can never hold (prompt + max tokens too long)
    peak: PeakGrid | None = None
    # the same at first admissions only, re-admissions after a recompute left out (vLLM's counters):
    # the prefix cache's own yield, not the blocks a preempted sequence finds of its own
    first_hit_tokens: int = 0
    first_looked_up_tokens: int = 0
    host_hit_blocks: int = 0    # prefix blocks the device missed and the host tier served (protocol 3)

    @property
    def hit_rate(self) -> float:
        return counters.hit_rate(self.hit_tokens, self.looked_up_tokens)

    @property
    def host_hit_tokens(self) -> int:
        return self.host_hit_blocks * self.config.pool.block_size


class LabReport(Struct, kw_only=True):
    workload: str
    requests: int
    sequences: int
    workload_tokens: int        # prompt tokens of every request + output tokens of every sample
    notes: list[str] = []       # how the workload was read (e.g. prompts rebuilt from hashes)
    rows: list[LabRow] = []
    seconds: float = 0.0        # wall time of all the runs


COLUMNS = ("config", "block_size", "device_blocks", "prefix_caching", "preemption", "watermark",
           "steps", "peak_used", "mean_used", "slot_util", "hit_rate", "preemptions", "recomputes",
           "swap_outs", "swap_ins", "swapped_blocks", "computed_tokens", "peak_entries", "mean_entries",
           "finished", "rejected")


def row_values(row: LabRow) -> dict:
    """One row as the table and the CSV show it."""
    p = row.config.pool
    return dict(zip(COLUMNS, (
        row.config.label, p.block_size, p.num_device_blocks, p.enable_prefix_caching, p.preemption_mode,
        row.config.watermark, row.steps, row.peak_used, round(row.mean_used, 2), round(row.slot_util, 4),
        round(row.hit_rate, 4), row.preemptions, row.recomputes, row.swap_outs, row.swap_ins,
        row.swapped_blocks, row.computed_tokens, row.peak_entries, round(row.mean_entries, 2),
        row.finished, len(row.rejected))))


def to_csv(report: LabReport) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    w.writeheader()
    for row in report.rows:
        w.writerow(row_values(row))
    return out.getvalue()


def decode_report(data: str | bytes) -> LabReport:
    return msgspec.json.decode(data, type=LabReport)


def encode_report(report: LabReport) -> bytes:
    return msgspec.json.encode(report)


def what_if(base: PoolConfig, pool: PoolConfig) -> str:
    """What a what-if config changes from the base pool, in words: '2× blocks (512 × 16)'."""
    if pool.enable_prefix_caching != base.enable_prefix_caching:
        return f"prefix caching {'on' if pool.enable_prefix_caching else 'off'}"
    shape = f"{pool.num_device_blocks:,} × {pool.block_size}"
    if pool.block_size != base.block_size:
        same = pool.num_device_blocks * pool.block_size == base.num_device_blocks * base.block_size
        return f"block size {pool.block_size} ({shape}{', the same memory' if same else ''})"
    ratio = pool.num_device_blocks / base.num_device_blocks
    return f"{ratio:g}× blocks ({shape})"


def what_if_lines(report: LabReport) -> list[str]:
    """Each row after the first against the first (the workload at its own config): the tokens the
    prefix cache serves at first admissions that it gains, '+412 tokens with 2× blocks (512 × 16):
    hit rate 31% → 45%'. Re-admissions after a recompute are left out (as vLLM counts): their hits
    are a preempted sequence's own blocks, which a bigger pool would not have had to find again."""
    if not report.rows:
        return []
    base = report.rows[0]
    rate = lambda r: counters.hit_rate(r.first_hit_tokens, r.first_looked_up_tokens)  # noqa: E731
    out = [f"at its own config ({base.config.label}): {base.first_hit_tokens:,} of {base.first_looked_up_tokens:,} "
           f"tokens hit ({rate(base):.1%})"]
    for row in report.rows[1:]:
        gain = row.first_hit_tokens - base.first_hit_tokens
        change = what_if(base.config.pool, row.config.pool)
        out.append(f"{'+' if gain >= 0 else '−'}{abs(gain):,} tokens with {change}: "
                   f"hit rate {rate(base):.1%} → {rate(row):.1%}")
    return out


# ------------------------------------------------------------------------------ trace sweeps
# `python -m engine.lab trace:PATH --sweep ... --json` prints a `TraceSweep` (engine/lab/trace_sweep.py);
# the dashboard decodes it here without importing the engine.
TRACE_REASONS = ("cold", "evicted", "in_flight", "partial_block", "recomputed")


class TracePoint(Struct, kw_only=True):
    """One replay of a trace: one eviction policy at one pool capacity."""
    policy: str
    blocks: int                 # device blocks of the pool
    tokens: int                 # blocks x block size
    bytes: int | None           # tokens x the model's KV bytes per token (None: no model named)
    hit_tokens: int             # prompt tokens served by the prefix cache
    looked_up_tokens: int       # tokens looked up at every admission (re-admissions after recompute too)
    missed: dict[str, int] = {}  # missed tokens by reason (TRACE_REASONS; they add up to looked_up - hit - host_hit)
    evictions: int = 0          # cached blocks evicted
    preemptions: int = 0
    rejected: int = 0           # requests this pool can never hold (prompt + output longer than it)
    finished: int = 0
    steps: int = 0              # engine steps the replay took
    seconds: float = 0.0        # wall time of this replay
    host_blocks: int = 0        # blocks of the host tier (protocol 3; 0: device only)
    host_hit_tokens: int = 0    # tokens the device missed and the host tier served

    @property
    def hit_rate(self) -> float:
        return counters.hit_rate(self.hit_tokens, self.looked_up_tokens)

    @property
    def tier_hit_rate(self) -> float:
        """Device and host tier together: tokens not recomputed over tokens looked up."""
        return counters.hit_rate(self.hit_tokens + self.host_hit_tokens, self.looked_up_tokens)


class TraceSweep(Struct, kw_only=True):
    """Hit rate against pool capacity, per eviction policy, with the trace's reuse ceiling."""
    trace: str
    requests: int               # requests replayed (the first N of the file)
    prompt_tokens: int
    output_tokens: int
    block_size: int
    one_at_a_time: bool         # True: each request admitted once the one before finished
    step_ms: float              # wall time of one engine step (arrivals: timestamp / step_ms)
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0  # a prefill's most tokens a step (0: no cap)
    model: str | None = None    # whose KV bytes per token size `bytes`
    bytes_per_token: int | None = None
    ceiling_hit_tokens: int = 0  # the exact reuse ceiling (an unlimited pool, one request at a time)
    unlimited_blocks: int = 0    # a pool that never evicts on this trace
    points: list[TracePoint] = []
    seconds: float = 0.0

    @property
    def ceiling(self) -> float:
        return counters.hit_rate(self.ceiling_hit_tokens, self.prompt_tokens)


def encode_sweep(sweep: TraceSweep) -> bytes:
    return msgspec.json.encode(sweep)


def decode_sweep(data: str | bytes) -> TraceSweep:
    return msgspec.json.decode(data, type=TraceSweep)
