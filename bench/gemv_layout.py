"""The GEMV's weight layout end to end: batch-1 decode with the weights as the engine lays them
out beside the same model with every GEMV in one layout, interleaved.

kernels/linear.py reads a GEMV's weights in rows, serial (the same rows one after another) or,
for bf16 operands (a bf16 copy of fp32 weights in `float32+bfloat16`, or the weights of
`bfloat16`), packed by gemv_pack into one sequential stream, whichever `choose_gemv` timed
fastest for each kind of layer where the model loads (docs/benchmarks.md, "The GEMV's way,
chosen per machine"). bench/gemv.py times each shape alone; this checks the choice where a user sees it: the
140+128 job's decode (its time less a 140-token prefill's), on two copies of the model, the
second with each GEMV of the first in `--layout`, A B, B A, ... Reports tokens/s medians
(min..max), the median of per-round ratios, and whether both sides generated the same tokens
(every layout sums in the same order, so they should).

    python -m bench.gemv_layout [--models smollm2,gemma3] [--dtypes bfloat16,float32+bfloat16]
                                [--layout rows|serial|packed] [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.prompts import make_prompts
from bench.rounds import interleave, ratios, spread
from bench.throughput import cpu_report, machine, make_engine
from engine.core.sequence import SamplingParams
from engine.model.engine import LLMEngine
from engine.model.model_loader import load_model
from engine.model.model_runner import load_cpu_kernels, step_linears
from kernels.linear import GEMV_LAYOUTS, Linear, gemv_way, into_huge_pages, set_gemv

PROMPT, NEW = 140, 128


def engine(spec: str, dtype: str) -> tuple[LLMEngine, list[int]]:
    loaded = load_model(spec, device="cpu", dtype=dtype)
    prompt = next(x for x in make_prompts(loaded.tokenizer, 64) if len(x) >= PROMPT)[:PROMPT]
    return make_engine(loaded, [prompt], NEW + 1, 1), prompt


def linears(eng: LLMEngine) -> list[Linear]:
    return step_linears(eng.runner.layers, eng.runner.lm_head)


def mirror(chosen: list[Linear], other: list[Linear], layout: str) -> None:
    """Give `other` (the same model's Linears loaded again, whose own choice may differ) each of
    `chosen`'s GEMVs in `layout`; one `chosen` leaves to the GEMM stays there. Both read from 2 MB
    pages, as the engine keeps its GEMVs' operands (a new layout is a new copy)."""
    for a, b in zip(chosen, other, strict=True):
        set_gemv(b, "off" if gemv_way(a) == "off" else layout)
    into_huge_pages(other)


def layouts(eng: LLMEngine) -> str:
    """Each kind of layer's layout, as the first layer has it."""
    first, lm_head = eng.runner.layers[0], eng.runner.lm_head
    kinds = {"qkv": first.qkv, "o": first.o, "gate_up": first.gate_up, "down": first.down, "lm_head": lm_head}
    return " ".join(f"{k}:{gemv_way(lin)}" for k, lin in kinds.items() if lin)


def decode_rate(eng: LLMEngine, prompt: list[int], tokens: dict, name: str) -> float:
    """Decode tokens/s: the 140+128 job less a 140-token prefill, both run now."""
    times = []
    for new in (NEW + 1, 1):
        eng.clear_prefix_cache()
        t0 = time.perf_counter()
        out = eng.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))
        times.append(time.perf_counter() - t0)
        if new > 1:  # the token ids: the outputs' other fields differ between runs (request ids, times)
            tokens[name] = [o.token_ids for group in out for o in group]
    return NEW / (times[0] - times[1])


def compare(spec: str, dtype: str, layout: str, rounds: int) -> str:
    chosen, prompt = engine(spec, dtype)
    other, _ = engine(spec, dtype)
    mirror(linears(chosen), linears(other), layout)
    ours, theirs = layouts(chosen), layouts(other)
    tokens: dict = {}
    sides = {f"{ours} (chosen)": lambda: decode_rate(chosen, prompt, tokens, "chosen"),
             theirs: lambda: decode_rate(other, prompt, tokens, "other")}
    for side in sides.values():  # warm up
        side()
    res = interleave(sides, rounds)
    a, b = res.values()
    return (f"{spec} {dtype}: " + ", ".join(f"{k} {spread(v)} tok/s" for k, v in res.items())
            + f"; chosen / other {spread(ratios(b, a), '.2f')}x; same tokens: {tokens['chosen'] == tokens['other']}")


def decode_bench_parser(doc: str, dtypes: str) -> argparse.ArgumentParser:
    """The arguments of the benches that decode the bundled models on two sides (this one,
    bench.decode_step, bench.huge_pages)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--dtypes", default=dtypes)
    ap.add_argument("--rounds", type=int, default=5)
    return ap


def require_kernels() -> None:
    if not load_cpu_kernels():
        raise SystemExit("the C++ CPU kernels did not load: what this bench measures is theirs")


def main() -> None:
    ap = decode_bench_parser(__doc__, "bfloat16,float32+bfloat16")
    ap.add_argument("--layout", default="rows", choices=GEMV_LAYOUTS, help="the other side's GEMVs'")
    args = ap.parse_args()
    require_kernels()
    print(f"bench.gemv_layout, {machine()}, {torch.get_num_threads()} threads\n{cpu_report()}", flush=True)
    for spec in args.models.split(","):
        for dtype in args.dtypes.split(","):
            print(compare(spec, dtype, args.layout, args.rounds), flush=True)


if __name__ == "__main__":
    main()
