"""A workload under several configs: the configs to try, the runs, and the table they make."""
from __future__ import annotations

import itertools
import time

import msgspec

from kvscope_contract.lab import LabConfig, LabReport, LabRow, row_values
from kvscope_contract.state import CACHED, FREE, SHARED
from kvscope_contract.kv_groups import gemma3_groups
from engine.lab.sim import Lab
from engine.lab.workload import Workload


def configs(base: LabConfig, block_sizes=(), blocks=(), caching=(), preemption=(), watermarks=(),
            host_blocks=(), windows=()) -> list[LabConfig]:
    """Every combination of the values given, each axis defaulting to the base's value. A block
    size given without a number of blocks keeps the base pool's memory (blocks x block size).
    A window W makes the pool Gemma 3's hybrid shape (`gemma3_groups`); None, full attention."""
    pool_tokens = base.pool.num_device_blocks * base.pool.block_size
    out = []
    for bs, n, cache, mode, wm, host, window in itertools.product(
            block_sizes or [base.pool.block_size], blocks or [None], caching or [base.pool.enable_prefix_caching],
            preemption or [base.pool.preemption_mode], watermarks or [base.watermark],
            host_blocks or [base.pool.num_host_blocks], windows or ["base"]):
        n = n or (max(1, pool_tokens // bs) if block_sizes else base.pool.num_device_blocks)
        groups = base.pool.kv_groups if window == "base" else gemma3_groups(window) if window else []
        pool = msgspec.structs.replace(base.pool, block_size=bs, num_device_blocks=n, enable_prefix_caching=cache,
                                       preemption_mode=mode, num_host_blocks=host, bytes_per_block=0,
                                       kv_groups=groups)
        out.append(msgspec.structs.replace(base, pool=pool, watermark=wm))
    return out




def what_if_configs(base: LabConfig) -> list[LabConfig]:
    """The base, then what would make more of it hit: prefix caching on when it is off; else twice
    the blocks, and half the block size at the same memory (docs/misses.md)."""
    pool = base.pool
    if not pool.enable_prefix_caching:
        changes = [dict(enable_prefix_caching=True)]
    else:
        changes = [dict(num_device_blocks=2 * pool.num_device_blocks)]
        if pool.block_size > 1:
            changes.append(dict(block_size=pool.block_size // 2, num_device_blocks=2 * pool.num_device_blocks))
    return [base] + [msgspec.structs.replace(base, pool=msgspec.structs.replace(pool, **c)) for c in changes]


def run(workload: Workload, cfgs: list[LabConfig], fast: bool = True) -> LabReport:
    t0 = time.perf_counter()
    rows = [Lab(cfg, workload).run(fast=fast) for cfg in cfgs]
    return LabReport(workload=workload.name, requests=len(workload.requests), sequences=workload.sequences,
                     workload_tokens=workload.tokens, notes=list(workload.notes), rows=rows,
                     seconds=time.perf_counter() - t0)


HEADERS = {"config": "config", "steps": "steps", "peak_used": "peak used", "mean_used": "mean used",
           "slot_util": "slot util", "hit_rate": "hit rate", "preemptions": "preempt", "recomputes": "recomp",
           "swap_outs": "swap out", "swap_ins": "swap in", "swapped_blocks": "blk moved",
           "computed_tokens": "computed", "peak_entries": "entries pk", "mean_entries": "entries avg",
           "finished": "finished", "rejected": "rejected"}


def format_table(report: LabReport) -> str:
    rows = [row_values(r) for r in report.rows]
    cells = [[_cell(k, r[k]) for k in HEADERS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADERS.values())]
    line = lambda xs: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(xs, widths)))
    return "\n".join([line(list(HEADERS.values())), line(["-" * w for w in widths])] + [line(c) for c in cells])


def _cell(key: str, value) -> str:
    if key in ("slot_util", "hit_rate"):
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


GLYPHS = {FREE: ".", CACHED: "c", SHARED: "S"}


def ascii_grid(row: LabRow, width: int = 64) -> str:
    """The pool at its peak, one character a block: . free, c cached, # used (+ partly filled), S shared."""
    g = row.peak
    if g is None:
        return "(no block was ever used)"
    bs = row.config.pool.block_size
    chars = [GLYPHS.get(s) or ("#" if t >= bs else "+") for s, t in zip(g.states, g.tokens)]
    return "\n".join("".join(chars[i:i + width]) for i in range(0, len(chars), width))


def default_base(workload: Workload) -> LabConfig:
    return LabConfig(pool=msgspec.structs.replace(workload.base, bytes_per_block=0))

