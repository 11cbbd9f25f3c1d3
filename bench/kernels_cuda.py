"""Check every Triton kernel against the torch path on a CUDA device at realistic shapes, and time
them. Exits 1 on a mismatch, 2 when there is no CUDA device. About a minute on one GPU.

SmolLM2-135M attention dims (9 query heads, 3 KV heads, head_dim 64), block size 16, bf16 and
fp32; decode batches of 32 to 256 sequences with contexts up to 4k, prefill and a mixed batch.
Paged attention (Triton, and the torch path) is checked against SDPA on contiguous K/V in float32;
the other kernels must match the torch path exactly.

    python -m bench.kernels_cuda [--quick]
"""
from __future__ import annotations

import argparse
import random
import sys

import torch
import torch.nn.functional as F

import kernels

H, KVH, D, BS = 9, 3, 64, 16
# against a float32 reference computed from the same (rounded) inputs
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-3), torch.bfloat16: dict(atol=5e-3, rtol=2e-2)}
CASES = {  # name: (cached prefix, new tokens) per sequence
    "decode 32 x 4k": [(4095, 1)] * 32,
    "decode 256 x 1k..4k": [(random.Random(i).randint(1024, 4096) - 1, 1) for i in range(256)],
    "decode 256 x 512": [(511, 1)] * 256,
    "prefill 8 x 1k": [(0, 1024)] * 8,
    "mixed: 2 chunks 512 on 2k + 126 decodes 2k": [(2048, 512)] * 2 + [(2047, 1)] * 126,
}
failures: list[str] = []


def bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=50)


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype) -> float:
    err = (actual.float() - expected.float()).abs().max().item()
    if not torch.allclose(actual.float(), expected.float(), **TOL.get(dtype, dict(atol=0, rtol=0))):
        failures.append(f"{name}: max abs error {err:.3g}")
    return err


def make(specs, dtype):
    need = [-(-(p + q) // BS) for p, q in specs]
    ids = list(range(sum(need) + 16))
    random.Random(0).shuffle(ids)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(specs))]
    slots = [t[i // BS] * BS + i % BS for t, (p, q) in zip(tables, specs) for i in range(p, p + q)]
    meta = kernels.build_attention_metadata([q for _, q in specs], [p + q for p, q in specs], tables, slots, BS, "cuda")
    kv = torch.randn(1, 2, len(ids), BS, KVH, D, device="cuda", dtype=dtype)
    query = torch.randn(len(slots), H, D, device="cuda", dtype=dtype)
    return meta, kv, query, tables


def contiguous_sdpa(query, kv, tables, specs, scale):
    """Reference: per sequence, K/V copied out contiguously, heads expanded, explicit causal
    mask, in float32 whatever the inputs."""
    out, row = [], 0
    for t, (p, q) in zip(tables, specs):
        idx = torch.tensor(t, device="cuda")
        k, v = (kv[0, i][idx].flatten(0, 1)[:p + q].transpose(0, 1).repeat_interleave(H // KVH, 0).float()
                for i in (0, 1))
        mask = torch.arange(p + q, device="cuda")[None] <= torch.arange(p, p + q, device="cuda")[:, None]
        out.append(F.scaled_dot_product_attention(query[row:row + q].transpose(0, 1).float(), k, v, attn_mask=mask,
                                                  scale=scale).transpose(0, 1))
        row += q
    return torch.cat(out)


def folded_decode_sdpa(query, L, dtype):
    """Timing baseline for equal-length decode: SDPA on contiguous [B, kvh, L, d] K/V, heads folded."""
    B = query.shape[0]
    k, v = torch.randn(2, B, KVH, L, D, device="cuda", dtype=dtype)
    q = query.view(B, KVH, H // KVH, D)
    return lambda: F.scaled_dot_product_attention(q, k, v)


def attention_rows(dtype, quick: bool):
    for name, specs in CASES.items():
        if quick and "256 x 1k" in name:
            continue
        meta, kv, query, tables = make(specs, dtype)
        scale = D ** -0.5
        run_triton = lambda: kernels.paged_attention_triton(query, kv[0, 0], kv[0, 1], meta, scale)
        run_torch = lambda: kernels.paged_attention_torch(query, kv[0, 0], kv[0, 1], meta, scale)
        out = run_triton()
        ref = contiguous_sdpa(query, kv, tables, specs, scale)
        e1 = check(f"paged_attention triton {name} {dtype}", out, ref, dtype)
        e2 = check(f"paged_attention torch path {name} {dtype}", run_torch(), ref, dtype)
        t_tri, t_torch = bench(run_triton), bench(run_torch)
        equal = all(q == 1 for _, q in specs) and len({p for p, _ in specs}) == 1
        t_sdpa = bench(folded_decode_sdpa(query, sum(specs[0]), dtype)) if equal else float("nan")
        kv_bytes = sum(p + q for p, q in specs) * KVH * D * 2 * kv.element_size()
        yield (f"paged_attention {name}", dtype, t_tri, t_torch, t_sdpa, kv_bytes / t_tri / 1e6, max(e1, e2))


def row(name, dtype, run_triton, run_torch, nbytes, err):
    t_tri = bench(run_triton)
    return name, dtype, t_tri, bench(run_torch), float("nan"), nbytes / t_tri / 1e6, err


def store_row(dtype):
    T = 8192
    kv = torch.randn(1, 2, 4096, BS, KVH, D, device="cuda", dtype=dtype)
    slots = torch.randperm(4096 * BS, device="cuda")[:T]
    slots[::97] = -1
    key, value = torch.randn(2, T, KVH, D, device="cuda", dtype=dtype)
    ref = kv.clone()
    kernels.store_kv_torch(key, value, ref[0, 0], ref[0, 1], slots)
    kernels.store_kv_triton(key, value, kv[0, 0], kv[0, 1], slots)
    err = check(f"store_kv {dtype}", kv, ref, None)
    return row(f"store_kv {T} tokens", dtype, lambda: kernels.store_kv_triton(key, value, kv[0, 0], kv[0, 1], slots),
               lambda: kernels.store_kv_torch(key, value, kv[0, 0], kv[0, 1], slots), 4 * key.nbytes, err)


def copy_rows(dtype):
    layers, blocks, n = 30, 4096, 256
    kv = torch.randn(layers, 2, blocks, BS, KVH, D, device="cuda", dtype=dtype)
    host = torch.zeros(layers, 2, 1024, BS, KVH, D, dtype=dtype, pin_memory=True)
    src = random.Random(1).sample(range(blocks // 2), n)
    nbytes = 2 * layers * n * kv[0, 0, 0].nbytes
    cases = [("copy_blocks", kv, kv, list(zip(src, range(blocks // 2, blocks // 2 + n)))),
             ("swap out", kv, host, list(zip(src, range(n)))),
             ("swap in", host, kv, list(zip(range(n), range(blocks - n, blocks))))]
    for name, a, b, pairs in cases:
        ref = b.clone()
        if name == "copy_blocks":
            kernels.copy_blocks_torch(ref, pairs)
            kernels.copy_blocks_triton(b, pairs)
            tri = lambda: kernels.copy_blocks_triton(b, pairs)
            tor = lambda: kernels.copy_blocks_torch(b, pairs)
        else:
            kernels.swap_blocks_torch(a, ref, pairs)
            kernels.swap_blocks_triton(a, b, pairs)
            tri = lambda: kernels.swap_blocks_triton(a, b, pairs)
            tor = lambda: kernels.swap_blocks_torch(a, b, pairs)
        err = check(f"{name} {dtype}", b, ref, None)
        yield row(f"{name} {n} blocks x {layers} layers", dtype, tri, tor, nbytes, err)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the largest attention case")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels_cuda.py needs a CUDA device: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}). Nothing was run.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; times in ms (triton.testing.do_bench)")
    print(f"{'kernel / case':<52} {'dtype':<9} {'triton':>8} {'torch':>8} {'sdpa':>8} {'GB/s':>7} {'max err':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        rows = [store_row(dtype), *copy_rows(dtype), *attention_rows(dtype, args.quick)]
        for name, dt, t_tri, t_torch, t_sdpa, gbs, err in rows:
            print(f"{name:<52} {str(dt)[6:]:<9} {t_tri:>8.3f} {t_torch:>8.3f} {t_sdpa:>8.3f} {gbs:>7.0f} {err:>9.2e}",
                  flush=True)
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("all kernels match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
