"""vLLM's side of bench/throughput.py: one vLLM CPU engine, run by the vLLM venv's python.

Started by `bench.throughput` as a subprocess (vLLM brings its own torch and must not share a
process or a venv with the project); it imports vLLM and the standard library only. It loads
the model once, then answers one JSON request per stdin line with one JSON line on the result
channel (the original stdout; vLLM's own logging goes to stderr):

    {"op": "generate", "prompts": [[token ids], ...], "max_tokens": 128}
        -> {"seconds": 4.2, "token_ids": [[...], ...]}
    {"op": "profile", "prompts": ..., "max_tokens": ..., "row_limit": 25}
        -> {"seconds": ..., "token_ids": ..., "table": "<torch profiler key_averages table>"}

Greedy, EOS ignored, no prefix caching (the rounds repeat prompts: a cache would make every
round after the first a cache hit), block size 32 (vLLM's CPU attention needs a multiple of 32).

    .venv-vllm/bin/python bench/vllm_side.py --model FOLDER --dtype bfloat16 [--eager]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face model folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    results = os.fdopen(os.dup(1), "w", buffering=1)  # the parent reads this; everything else -> stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: 32 x 384 tokens need ~0.6 GiB in fp32
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.eager, max_model_len=args.max_model_len,
              enable_prefix_caching=False, block_size=32, seed=0)
    send = lambda obj: results.write(json.dumps(obj) + "\n")
    send({"ready": True, "load_seconds": round(time.perf_counter() - t0, 1), "vllm": vllm.__version__})

    def generate(req: dict) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "generate":
            send(generate(req))
        elif req["op"] == "profile":  # the engine core must run in this process (see the parent)
            import torch
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = generate(req)
            out["table"] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                     row_limit=req.get("row_limit", 25))
            send(out)
        elif req["op"] == "quit":
            break
        else:
            send({"error": f"unknown op {req['op']!r}"})


if __name__ == "__main__":
    main()
