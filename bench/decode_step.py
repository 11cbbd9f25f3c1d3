"""A decode step's layers in one call of the C++ kernels against the same layers op by op, on one
loaded model, interleaved.

engine/model/decode_step.py runs every layer of a decode step of 1-4 rows in one OpenMP region;
otherwise the runner calls the kernels one by one, each in a region of its own (as it still does
for prefill). Both compute the same bits (tests/unit/test_decode_step.py). This measures the
difference where a user sees it: batch-1 decode after a 140-token prompt (the 140+128 job less
the prefill, bench/gemv_layout.py's measure), A B, B A, ...; per side the weight bytes a decoded
token reads per second, against a plain read of a large buffer on the same cores. Reports
medians (min..max), the median of per-round ratios, and whether both sides generated the same
tokens.

    python -m bench.decode_step [--models smollm2,gemma3] [--dtypes float32,bfloat16,float32+bfloat16] [--rounds 5]
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from bench.gemv_layout import decode_bench_parser, decode_rate, engine, require_kernels
from bench.rounds import interleave, ratios, spread
from bench.throughput import cpu_report, machine, memory_read_bandwidth, weight_bytes
from engine.model import decode_step

HEAD = ("| model, dtype | one call, tok/s | op by op, tok/s | one call / op by op | weights read, one call | "
        "same tokens |\n|---|---|---|---|---|---|")


@contextlib.contextmanager
def op_by_op() -> Iterator[None]:
    """The runner's steps op by op while inside, as for a step decode_step does not take."""
    takes = decode_step.takes
    decode_step.takes = lambda *_: False
    try:
        yield
    finally:
        decode_step.takes = takes


def compare(spec: str, dtype: str, rounds: int, read_gbs: float, huge_gbs: float) -> str:
    """One table row: the model in `dtype` decoding both ways, `rounds` rounds after a warm one."""
    eng, prompt = engine(spec, dtype)
    tokens: dict = {}

    def ops() -> float:
        with op_by_op():
            return decode_rate(eng, prompt, tokens, "op by op")
    sides = {"one call": lambda: decode_rate(eng, prompt, tokens, "one call"), "op by op": ops}
    for side in sides.values():
        side()
    res = interleave(sides, rounds)
    gbs = statistics.median(res["one call"]) * weight_bytes(eng.loaded.model, eng.loaded.gemv_dtype) / 1e9
    return (f"| {spec}, {dtype} | {spread(res['one call'])} | {spread(res['op by op'])} | "
            f"**{spread(ratios(res['op by op'], res['one call']), '.2f').replace(' (', 'x** (', 1)} | {gbs:.1f} GB/s, "
            f"{gbs / read_gbs:.0%} of the plain read ({gbs / huge_gbs:.0%} on 2 MB pages) | "
            f"{tokens['one call'] == tokens['op by op']} |")


def main() -> None:
    args = decode_bench_parser(__doc__, "float32,bfloat16,float32+bfloat16").parse_args()
    require_kernels()
    read_gbs, huge_gbs = memory_read_bandwidth(), memory_read_bandwidth(huge_pages=True)
    print(f"bench.decode_step, {time.strftime('%Y-%m-%d %H:%M')}, {machine()} (the machine may be shared), "
          f"{torch.get_num_threads()} threads\n{cpu_report()}\nplain read (torch sum over 1 GiB, best of 5): "
          f"{read_gbs:.1f} GB/s; on 2 MB pages, as the engine keeps the weights: {huge_gbs:.1f} GB/s\n\n{HEAD}",
          flush=True)
    for spec in args.models.split(","):
        for dtype in args.dtypes.split(","):
            print(compare(spec, dtype, args.rounds, read_gbs, huge_gbs), flush=True)


if __name__ == "__main__":
    main()
