"""Cost of the paged attention paths (store_kv + paged attention: the torch path, and the C++
CPU kernel, which reads decode rows' K/V in place) against plain SDPA on K/V that is already
contiguous, same shapes, same GQA folding, on this CPU.

Each repeat runs every layer once with the contiguous baseline and then with the paged path
(alternating, so both see the same machine load), like the engine does: by default 30 layers,
each with its own K/V, so neither side finds the previous layer's data in cache. The figure is
the median over repeats of per-layer time; the ratio is the median of the per-repeat ratios
(and, less sensitive to other processes on a shared machine, the ratio of the fastest repeats).
The metadata (built once per step, its torch-path plan included) is timed apart, per step.

    python -m bench.attention [--layers 30] [--repeats 15] [--block-size 16] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

import kernels
from engine.model.model_runner import load_cpu_kernels
from kernels import cpu_build

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M: 9 query heads, 3 KV heads
CASES = {  # name: (cached prefix, new tokens) per sequence; block tables shuffled unless "in order"
    "decode 32 x 512": [(511, 1)] * 32,
    "decode 32 x 512, blocks in order": [(511, 1)] * 32,
    "decode 32 x 16..1024 (SDPA padded)": [(random.Random(i).randint(16, 1024) - 1, 1) for i in range(32)],
    "prefill 4 x 512": [(0, 512)] * 4,
    "chunk 256 on 256 + decode 31 x 512": [(256, 256)] + [(511, 1)] * 31,
}


def setup(specs, layers: int, block_size: int, dtype: torch.dtype, shuffle: bool = True):
    need = [-(-(p + q) // block_size) for p, q in specs]
    ids = list(range(sum(need) + 64))
    if shuffle:  # out-of-order block tables, as after churn: the gather's worst case
        random.Random(0).shuffle(ids)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(specs))]
    slots = [t[i // block_size] * block_size + i % block_size for t, (p, q) in zip(tables, specs)
             for i in range(p, p + q)]
    args = ([q for _, q in specs], [p + q for p, q in specs], tables, slots, block_size, "cpu")
    T = sum(q for _, q in specs)
    kv = torch.randn(layers, 2, len(ids), block_size, KV_HEADS, HEAD_DIM, dtype=dtype)
    query = torch.randn(T, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
    key, value = torch.randn(2, T, KV_HEADS, HEAD_DIM, dtype=dtype)
    return args, kv, query, key, value, [baseline_calls(specs, query) for _ in range(layers)]


def baseline_calls(specs, query) -> list[tuple]:
    """SDPA arguments over contiguous K/V for one layer, same folding as the paged path: decode
    rows batched ([D, kvh, g, d] against [D, kvh, L, d], padded + masked when ragged), prefill
    chunks one by one ([kvh, g, q, d] against K/V [kvh, L, d] broadcast over the group)."""
    calls, starts = [], [0]
    for _, q in specs:
        starts.append(starts[-1] + q)
    dec = [i for i, (_, q) in enumerate(specs) if q == 1]
    if dec:
        lens = torch.tensor([sum(specs[i]) for i in dec])
        L = int(lens.max())
        k, v = torch.randn(2, len(dec), KV_HEADS, L, HEAD_DIM, dtype=query.dtype)
        mask = None if bool((lens == L).all()) else (torch.arange(L) < lens[:, None]).view(-1, 1, 1, L)
        calls.append((query[dec].view(-1, KV_HEADS, GROUP, HEAD_DIM), k, v, mask, False))
    for i, (p, q) in enumerate(specs):
        if q > 1:
            k, v = torch.randn(2, KV_HEADS, 1, p + q, HEAD_DIM, dtype=query.dtype).expand(2, -1, GROUP, -1, -1)
            qs = query[starts[i]:starts[i + 1]].view(q, KV_HEADS, GROUP, HEAD_DIM).permute(1, 2, 0, 3)
            mask = torch.arange(p + q)[None] <= torch.arange(p, p + q)[:, None] if p else None
            calls.append((qs, k, v, mask, not p))
    return calls


def run_case(name, specs, layers, repeats, block_size, dtype):
    args, kv, query, key, value, calls = setup(specs, layers, block_size, dtype, "in order" not in name)
    scale = HEAD_DIM ** -0.5
    base, paged, native, build = [], [], [], []
    for _ in range(repeats + 2):  # the first two are warm-up
        t = time.perf_counter()
        meta = kernels.build_attention_metadata(*args)
        meta.decodes, meta.prefills  # the torch path's plan, otherwise made by the first layer
        build.append((time.perf_counter() - t) * 1e3)
        t0 = time.perf_counter()
        for layer in calls:
            for q, k, v, mask, causal in layer:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
        t1 = time.perf_counter()
        for l in range(layers):
            kernels.store_kv(key, value, kv[l, 0], kv[l, 1], meta.slot_mapping)
            kernels.paged_attention(query, kv[l, 0], kv[l, 1], meta, scale)
        t2 = time.perf_counter()
        if cpu_build.loaded():
            for l in range(layers):
                kernels.store_kv(key, value, kv[l, 0], kv[l, 1], meta.slot_mapping)
                kernels.paged_attention_cpu(query, kv[l, 0], kv[l, 1], meta, scale)
        t3 = time.perf_counter()
        base.append((t1 - t0) / layers * 1e3)
        paged.append((t2 - t1) / layers * 1e3)
        native.append((t3 - t2) / layers * 1e3)
    base, paged, native, build = base[2:], paged[2:], native[2:], build[2:]
    ratio = statistics.median(p / b for p, b in zip(paged, base))
    cpp = (f"{statistics.median(native):>10.3f} {statistics.median(n / b for n, b in zip(native, base)):>7.2f}x"
           if cpu_build.loaded() else f"{'-':>10} {'-':>8}")
    print(f"{name:<38} {statistics.median(base):>10.3f} {statistics.median(paged):>10.3f} {ratio:>7.2f}x "
          f"{min(paged) / min(base):>8.2f}x {cpp} {statistics.median(build):>10.3f}")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, block size "
          f"{args.block_size}, {args.layers} layers, median of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.2f} (the machine may be shared)")
    load_cpu_kernels()
    print(f"{'ms per layer; metadata: ms per step':<38} {'contiguous':>10} {'paged':>10} {'ratio':>8} "
          f"{'fastest':>9} {'C++':>10} {'ratio':>8} {'metadata':>10}")
    with torch.inference_mode():
        for name, specs in CASES.items():
            run_case(name, specs, args.layers, args.repeats, args.block_size, dtype)


if __name__ == "__main__":
    main()
