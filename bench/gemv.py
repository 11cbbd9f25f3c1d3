"""The CPU GEMV alone, at the model's shapes: GB/s of weights streamed, variants interleaved.

SmolLM2-135M's decode step at batch 1..4 is four GEMVs per layer (q|k|v 576->960, o 576->576,
gate|up 576->3072, down 1536->576) and the lm_head (576->49152, ~113 MB fp32). Each shape gets
enough distinct weight copies (>= 128 MB) that every call reads its weights from memory, as a
decode step does, in 2 MB pages as the engine keeps them (kernels/huge_pages.py); a timed pass is
one call on each copy, in turn. Sides are C++ kernel variants
(kernels.cpu_build.ISAS, each its torch.ops.kvscope_<isa>.gemv; `<isa>+packed` on weights in that
variant's gemv_pack layout, `<isa>+serial` reading the rows one after another), `torch` (x W^T by torch.mm) and
`read` (torch's sum over the same weights: what reading them costs, the GEMV's limit),
interleaved round by round (A B, B A, ...); the report is the median GB/s per side and shape with
its spread (min..max), and each side's ratio to the first as the median of per-round ratios.
On a shared machine, `--threads 1 --cpu-time` times one thread by its CPU time, which leaves out
the time it waited for a core (the memory it shares with other processes still counts).

--baseline REV also runs kernels/cpu/kvscope_cpu.cpp as it was at git revision REV, for each
variant named, as side `<isa>@REV` (bench/baseline.py), to A/B a kernel change in one process.
--emulate avx2 limits torch and oneDNN to AVX2, as bench.throughput --isa avx2 does.

    python -m bench.gemv [--sides avx2,avx2+packed,torch] [--baseline HEAD] [--rows 1,4]
                         [--dtype float32|bfloat16|float32+bfloat16] [--rounds 5]
                         [--threads 1 --cpu-time]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from bench import baseline
from bench.rounds import interleave, ratios
from bench.throughput import ISA_ENV, cpu_report, isa_environment, machine, reexec_with
from bench.baseline import BUILD_DIR
from kernels import cpu_build
from kernels.huge_pages import huge_page_copies
from kernels.linear import GEMV_LAYOUTS

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576),  # name: (N, K)
          # Gemma 3 270M (--model gemma3): its 262k-token lm_head is most of a decode step's bytes
          "g-qkv 640->1536": (1536, 640), "g-o 1024->640": (640, 1024), "g-gate_up 640->4096": (4096, 640),
          "g-down 2048->640": (640, 2048), "g-lm_head 640->262144": (262144, 640)}
COPY_BYTES = 128 << 20  # per shape: far beyond the last-level cache


def gemv_call(side: str, ops) -> Callable:
    if side == "read":  # no GEMV: torch's sum over the weights, the speed of reading them
        return lambda out, x, w: w.sum()
    if side == "torch":
        return lambda out, x, w: torch.mm(x, w.t(), out=out)
    layout = GEMV_LAYOUTS.index(side.partition("+")[2] or "rows")  # <isa>: rows, <isa>+<layout>
    if not layout:  # (as older kernels, --baseline's, are called: their layout was a bool)
        return lambda out, x, w: ops.gemv(out, x, w, None)
    return lambda out, x, w: ops.gemv(out, x, w, None, layout)


def timed_pass(call: Callable, weights: list[torch.Tensor], x: torch.Tensor, out: torch.Tensor,
               clock: Callable[[], float]) -> float:
    """GB/s of one call on each weight copy in turn."""
    t0 = clock()
    for w in weights:
        call(out, x, w)
    return sum(w.nbytes for w in weights) / (clock() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", default=None, help="comma-separated variants, torch, read (default: every "
                                                  "variant this CPU runs, torch and read)")
    ap.add_argument("--baseline", default=None, help="git revision whose kernels also run, as <isa>@REV")
    ap.add_argument("--rows", default="1,4", help="comma-separated rows of x (1..4)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float32+bfloat16"),
                    help="x's and the weights' (float32+bfloat16: fp32 x, bf16 weights, as the engine's "
                         "default on CPUs without bf16 products)")
    ap.add_argument("--shapes", default=None, help="comma-separated prefixes of shape names (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the thread's CPU time, not the wall clock (with --threads 1): on a shared "
                         "machine it leaves out the time the thread waited for a core")
    ap.add_argument("--emulate", choices=sorted(ISA_ENV), default=None, help="limit torch and oneDNN to this ISA")
    args = ap.parse_args()
    if args.emulate:
        reexec_with(isa_environment(args.emulate), "bench.gemv")
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        raise SystemExit("--cpu-time counts the calling thread only: add --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    x_name, _, w_name = args.dtype.partition("+")
    x_dtype, dtype = getattr(torch, x_name), getattr(torch, w_name or x_name)
    names = (args.sides or ",".join(cpu_build.runnable_isas() + ["torch", "read"])).split(",")
    sides: dict[str, Callable] = {}
    packs: dict[str, Callable] = {}  # side: its weights' layout (<isa>+packed: that variant's gemv_pack)
    for name in names:
        plain = name in ("torch", "read")
        ops = None if plain else cpu_build.load_variant(BUILD_DIR, name.partition("+")[0])
        sides[name] = gemv_call(name, ops)
        if name.endswith("+packed"):
            packs[name] = ops.gemv_pack
        if args.baseline and not plain and "+" not in name:  # (older kernels may lack a layout)
            old = getattr(torch.ops, f"kvscope_{baseline.load(name, args.baseline)}")
            sides[f"{name}@{args.baseline}"] = gemv_call(name, old)
    print(f"bench.gemv, {time.strftime('%Y-%m-%d %H:%M')}, {machine()} (the machine may be shared), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{'CPU time' if args.cpu_time else 'wall clock'}", flush=True)
    print(cpu_report(), flush=True)
    wanted = args.shapes.split(",") if args.shapes else None
    shapes = {k: v for k, v in SHAPES.items() if not wanted or any(k.startswith(p) for p in wanted)}
    first = next(iter(sides))
    print(f"{'shape':<20} {'rows':>4}  " + "  ".join(f"{s + ' GB/s':>22}" for s in sides)
          + "  " + " ".join(f"{s + ' / ' + first:>14}" for s in sides if s != first), flush=True)
    for label, (n, k) in shapes.items():
        copies = max(1, -(-COPY_BYTES // (n * k * dtype.itemsize)))
        weights = huge_page_copies([torch.randn(n, k).to(dtype) for _ in range(copies)])  # as the engine has them
        laid_out = {s: weights if s not in packs else huge_page_copies([packs[s](w) for w in weights]) for s in sides}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k).to(x_dtype)
            out = torch.empty(rows, n, dtype=x_dtype)
            ref = F.linear(x.float(), weights[0].float())
            for name, call in sides.items():  # each side warmed up, and checked against fp32 torch
                call(out, x, laid_out[name][0])
                if name == "read":
                    continue
                err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
                if err > (1e-5 if x_dtype == torch.float32 else 2e-2):
                    raise SystemExit(f"{name} {label} rows {rows}: relative error {err:.2g}")
            passes = {s: (lambda s=s, c=c: timed_pass(c, laid_out[s], x, out, clock)) for s, c in sides.items()}
            gbs = interleave(passes, args.rounds)
            cells = "  ".join(f"{statistics.median(v):>9.1f} ({min(v):5.1f}..{max(v):5.1f})" for v in gbs.values())
            rel = " ".join(f"{statistics.median(ratios(gbs[first], v)):>13.2f}x" for s, v in gbs.items() if s != first)
            print(f"{label:<20} {rows:>4}  {cells}  {rel}", flush=True)
        weights = laid_out = None  # freed before the next shape's copies


if __name__ == "__main__":
    main()
