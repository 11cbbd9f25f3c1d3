"""The GEMVs' weights in 2 MB pages end to end: batch-1 decode with the model as the engine loads
it (kernels/huge_pages.py) beside the same model with every GEMV's operand copied back into
torch's own memory (4 KB pages), interleaved.

The 140+128 job's decode (its time less a 140-token prefill's, bench/gemv_layout.py's measure),
on two loads of the model, the second given the first's GEMV ways (so only the pages differ),
A B, B A, ... Reports tokens/s medians (min..max), the median of per-round ratios, and whether
both sides generated the same tokens (they read the same values).

    python -m bench.huge_pages [--models smollm2,gemma3] [--dtypes float32,bfloat16,float32+bfloat16] [--rounds 5]
"""
from __future__ import annotations

import time

import torch

from bench.gemv_layout import decode_bench_parser, decode_rate, engine, layouts, linears, require_kernels
from bench.rounds import interleave, ratios, spread
from bench.throughput import cpu_report, machine, memory_read_bandwidth
from kernels.linear import Linear, gemv_way, replace_operand, set_gemv


def ordinary_pages(chosen: list[Linear], other: list[Linear]) -> None:
    """Give `other` (the same model loaded again) `chosen`'s GEMV ways, then its GEMVs' operands as
    copies in torch's own memory, as the engine had them before kernels/huge_pages.py."""
    for a, b in zip(chosen, other, strict=True):
        set_gemv(b, gemv_way(a))
        if b.gemv:
            replace_operand(b, b.plain.clone())


def compare(spec: str, dtype: str, rounds: int) -> str:
    huge, prompt = engine(spec, dtype)
    plain, _ = engine(spec, dtype)
    ordinary_pages(linears(huge), linears(plain))
    tokens: dict = {}
    sides = {"2 MB pages": lambda: decode_rate(huge, prompt, tokens, "2 MB"),
             "4 KB pages": lambda: decode_rate(plain, prompt, tokens, "4 KB")}
    for side in sides.values():  # warm up
        side()
    res = interleave(sides, rounds)
    return (f"| {spec}, {dtype} | {layouts(huge)} | {spread(res['2 MB pages'])} | {spread(res['4 KB pages'])} | "
            f"**{spread(ratios(res['4 KB pages'], res['2 MB pages']), '.2f').replace(' (', 'x** (', 1)} | "
            f"{tokens['2 MB'] == tokens['4 KB']} |")


def main() -> None:
    args = decode_bench_parser(__doc__, "float32,bfloat16,float32+bfloat16").parse_args()
    require_kernels()
    print(f"bench.huge_pages, {time.strftime('%Y-%m-%d %H:%M')}, {machine()} (the machine may be shared), "
          f"{torch.get_num_threads()} threads\n{cpu_report()}\nplain read (torch sum over 1 GiB, best of 5): "
          f"{memory_read_bandwidth():.1f} GB/s, on 2 MB pages {memory_read_bandwidth(huge_pages=True):.1f} GB/s\n\n"
          "| model, dtype | the GEMVs' ways | 2 MB pages, tok/s | 4 KB pages, tok/s | 2 MB / 4 KB | same tokens |\n"
          "|---|---|---|---|---|---|", flush=True)
    for spec in args.models.split(","):
        for dtype in args.dtypes.split(","):
            print(compare(spec, dtype, args.rounds), flush=True)


if __name__ == "__main__":
    main()
