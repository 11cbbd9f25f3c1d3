"""KVScope against itself on the CPU, interleaved: C++ kernel variants, dtypes, the torch path.

Each side is `variant:dtype`, the variant one of kernels.cpu_build.ISAS, `torch` (no C++
kernels: the path a CPU without them takes) or `<isa>@REV` (the kernels as they were at git
revision REV, bench/baseline.py: a kernel change end to end). Every side has its own copy of the model, prepared
(GEMM backends, GEMV choice) under its own variant; before each of its runs the engine's kernel
calls are pointed at that variant. The jobs are bench.throughput's (32 prompts of 16..256
tokens, 128 new tokens; batch 32 and batch 1), in rounds A B, B A, ... with medians and spread.
--emulate avx2 runs torch and oneDNN at most AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) as
bench.throughput --isa avx2 does.

    python -m bench.cpu_variants --sides avx2:float32,avx2:bfloat16 --emulate avx2 [--rounds 3]
    python -m bench.cpu_variants --sides generic:float32,torch:float32
    python -m bench.cpu_variants --sides avx2:float32,avx2@HEAD~1:float32 --emulate avx2 --jobs "batch 1" \
        --linear onednn+gemv
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import baseline
from bench.throughput import (ISA_ENV, KVScopeSide, cpu_report, isa_environment, machine, make_jobs,
                              memory_read_bandwidth, reexec_with, report, run_rounds, weight_bytes)
from bench.baseline import BUILD_DIR
from engine.model.model_loader import load_model
from engine.model import model_runner
from engine.model.model_runner import load_cpu_kernels
from kernels import cpu_build, linear


class VariantSide(KVScopeSide):
    def __init__(self, spec: str, model: str):
        self.variant, dtype = spec.split(":")
        self.ops_name = self.variant  # torch.ops.kvscope_<ops_name>
        if "@" in self.variant:
            isa, rev = self.variant.split("@")
            cpu_build.load_variant(BUILD_DIR, isa)  # checks that this CPU runs it
            self.ops_name = baseline.load(isa, rev)
        elif self.variant != "torch":
            cpu_build.load_variant(BUILD_DIR, self.variant)
        super().__init__(load_model(model, dtype=dtype))  # its own copy: prepared under its own variant
        self.name = f"{self.variant} {dtype}"
        self.prepared = False

    def run(self, job):
        if self.variant == "torch":
            cpu_build._state.update(loaded=False, why="bench.cpu_variants: the torch path", isa=None)
        else:  # the engine's kernel calls go to torch.ops.kvscope_<isa in the state>
            cpu_build._state.update(loaded=True, why="", isa=self.ops_name)
        if not self.prepared:  # the GEMM/GEMV choice is made for this variant, not taken from another side's
            linear._choice.clear()
            self.prepared = True
        return super().run(job)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", required=True, help="comma-separated variant:dtype, e.g. avx2:float32,avx2:bfloat16")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--jobs", default="batch", help="comma-separated prefixes of job names (default: both batches)")
    ap.add_argument("--linear", default=None, choices=["torch", "onednn", "torch+gemv", "onednn+gemv"],
                    help="the GEMM backend (and GEMV or not) on every side; by default each side times the "
                         "choice (kernels.linear.choose_backend and choose_gemv), which on a loaded machine "
                         "can flip between sides and runs, so an A/B of kernel code should pin it")
    ap.add_argument("--emulate", choices=sorted(ISA_ENV), default=None, help="limit torch and oneDNN to this ISA")
    args = ap.parse_args()
    if args.emulate:
        reexec_with(isa_environment(args.emulate), "bench.cpu_variants")
    print(f"bench.cpu_variants, {time.strftime('%Y-%m-%d %H:%M')}, {machine()} (the machine may be shared), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    load_cpu_kernels(print)
    print(cpu_report(), flush=True)
    if args.linear:
        backend, _, gemv = args.linear.partition("+")
        model_runner.choose_backend = lambda layers, repeats=5, gemv_dtype=None: (backend, bool(gemv))
        model_runner.choose_gemv = lambda lins, **_: None  # the GEMV's operand stays as built: rows
    sides = [VariantSide(spec, args.model) for spec in args.sides.split(",")]
    jobs = [j for j in make_jobs(sides[0].loaded.tokenizer, args.requests, args.new_tokens)
            if any(j.name.startswith(x) for x in args.jobs.split(","))]
    res = run_rounds(jobs, sides, args.rounds)
    print(report(jobs, sides, res, "-").replace("kvscope / ", f"{sides[0].name} / "))
    gbs = memory_read_bandwidth()
    for side in sides:
        if ("batch 1", side.name) in res.seconds:
            one = next(j for j in jobs if j.name == "batch 1")
            tok_s = one.figure(statistics.median(res.seconds[("batch 1", side.name)]))
            mb = weight_bytes(side.loaded.model, side.loaded.gemv_dtype) / 1e6
            print(f"batch 1, {side.name}: {tok_s:.1f} tok/s x {mb:.0f} MB of weights = {tok_s * mb / 1e3:.1f} GB/s; "
                  f"the machine reads {gbs:.1f} GB/s")


if __name__ == "__main__":
    main()
