"""Output tokens/s of the paged engine against transformers generate(), in one process.

The same 32 prompts (16..256 tokens, no shared prefixes), 128 new tokens each, EOS ignored,
greedy: through this engine (every prompt through the paged cache) and through transformers
`generate()` (batched, left padded); then one prompt alone (batch 1) through both.

    python -m bench.throughput [--model smollm2] [--requests 32] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from engine.contract import protocol as p
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import load_model
from engine.model_runner import _linear
from engine.sequence import SamplingParams
from bench.prompts import make_prompts

def run_engine(loaded, prompts, new_tokens: int, max_num_seqs: int) -> tuple[float, int]:
    blocks = sum(-(-(len(x) + new_tokens) // 16) for x in prompts) + 16
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=2048, pool=p.PoolConfig(
        num_device_blocks=blocks, num_host_blocks=0, max_num_seqs=max_num_seqs)), loaded)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    engine.log.drain()
    return elapsed, sum(len(o.token_ids) for group in outs for o in group)


@contextmanager
def onednn_linears():
    """transformers with the engine's fp32 GEMM choice (oneDNN, not MKL): isolates what paging,
    batching and the unpadded flat batch are worth from what the GEMM backend is worth."""
    forward = torch.nn.Linear.forward
    torch.nn.Linear.forward = lambda self, x: _linear(self, x)
    try:
        yield
    finally:
        torch.nn.Linear.forward = forward


@torch.inference_mode()
def run_hf(loaded, prompts, new_tokens: int) -> tuple[float, int]:
    width = max(len(x) for x in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(prompts):  # left padding
        ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    out = loaded.model.generate(ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                                generation_config=cfg)
    elapsed = time.perf_counter() - t0
    return elapsed, (out.shape[1] - width) * len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16; both runs use it")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true", help="time the engine only")
    ap.add_argument("--hf-onednn", action="store_true",
                    help="also time transformers with the engine's fp32 GEMM backend (oneDNN)")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    prompts = make_prompts(loaded.tokenizer, args.requests)
    print(f"{loaded.name} on {loaded.device} ({loaded.dtype}), torch threads {torch.get_num_threads()}")
    run_engine(loaded, prompts[:2], 4, 2)  # warm up
    for label, batch in ((f"batch {args.requests}", prompts), ("batch 1", prompts[len(prompts) // 2:][:1])):
        t_e, n_e = run_engine(loaded, batch, args.new_tokens, max(len(batch), 1))
        line = f"{label}: engine {n_e / t_e:7.1f} tok/s ({n_e} tokens in {t_e:.1f} s)"
        if not args.skip_hf:
            t_h, n_h = run_hf(loaded, batch, args.new_tokens)
            line += (f" | transformers generate {n_h / t_h:7.1f} tok/s ({t_h:.1f} s)"
                     f" | ratio {(n_e / t_e) / (n_h / t_h):.2f}x")
            if args.hf_onednn:
                with onednn_linears():
                    t_o, n_o = run_hf(loaded, batch, args.new_tokens)
                line += (f" | transformers with oneDNN linears {n_o / t_o:7.1f} tok/s"
                         f" | ratio {(n_e / t_e) / (n_o / t_o):.2f}x")
        print(line, flush=True)


if __name__ == "__main__":
    main()
