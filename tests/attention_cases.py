"""Paged-attention cases the kernel tests share: ragged batches of cached prefixes and new tokens
on shuffled block tables, and naive attention to compare with."""
from __future__ import annotations

import random

import torch

import kernels


def close(actual, expected, dtype=torch.float32):
    tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(actual, expected, **tol)


POISON = 1e4  # K/V no kernel may read: a block wholly before a window, or block 0 (what NULL entries map to)


def make_batch(specs, block_size, kv_heads, group, head_dim=16, dtype=torch.float32, seed=0, spare=3, window=0):
    """specs: (cached prefix length, new tokens) per sequence. Blocks are handed out shuffled so
    block tables are out of order; the cache starts as noise so stray reads show up. The new
    tokens' K/V are stored with store_kv_torch, as the engine does before attention. Block 0 is
    nobody's and holds POISON. window > 0: the blocks wholly before the window of a sequence's first
    new token leave its table (NULL_BLOCK, -1), as the block manager frees them, and hold POISON."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    need = [-(-(p + q) // block_size) for p, q in specs]
    ids = list(range(1, sum(need) + spare + 1))
    random.Random(seed).shuffle(ids)
    kv = rnd(1, 2, len(ids) + 1, block_size, kv_heads, head_dim)
    kv[:, :, 0] = POISON
    tables, slots, full_k, full_v, gone = [], [], [], [], []
    for (p, q), n in zip(specs, need):
        table, ids = ids[:n], ids[n:]
        seq_slots = [table[i // block_size] * block_size + i % block_size for i in range(p + q)]
        slots += seq_slots[p:]
        flat_k, flat_v = kv[0, 0].view(-1, kv_heads, head_dim), kv[0, 1].view(-1, kv_heads, head_dim)
        idx = torch.tensor(seq_slots, dtype=torch.long)
        k_new, v_new = rnd(q, kv_heads, head_dim), rnd(q, kv_heads, head_dim)
        full_k.append(torch.cat([flat_k[idx[:p]], k_new]))
        full_v.append(torch.cat([flat_v[idx[:p]], v_new]))
        out_of_window = max(0, p - window + 1) // block_size if window else 0
        gone += table[:out_of_window]
        tables.append([-1] * out_of_window + table[out_of_window:])
    kv[:, :, gone] = POISON
    key = torch.cat([k[p:] for k, (p, _) in zip(full_k, specs)])
    value = torch.cat([v[p:] for v, (p, _) in zip(full_v, specs)])
    meta = kernels.build_attention_metadata([q for _, q in specs], [p + q for p, q in specs], tables,
                                            slots, block_size, "cpu", window)
    kernels.store_kv_torch(key, value, kv[0, 0], kv[0, 1], meta.slot_mapping)
    query = rnd(key.shape[0], kv_heads * group, head_dim)
    return query, kv, meta, full_k, full_v


def naive_attention(query, full_k, full_v, specs, group, scale, window=0):
    """Per sequence, contiguous K/V, repeated heads, explicit causal mask (and window), in float64."""
    outs, row = [], 0
    for k, v, (p, q) in zip(full_k, full_v, specs):
        qs = query[row:row + q].double().transpose(0, 1)                     # [H, q, d]
        ks = k.double().repeat_interleave(group, 1).transpose(0, 1)          # [H, L, d]
        vs = v.double().repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        keys, pos = torch.arange(p + q)[None, :], torch.arange(p, p + q)[:, None]
        allowed = (keys <= pos) & ((keys > pos - window) if window else True)
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        row += q
    return torch.cat(outs).to(query.dtype)


MIXED = [(0, 7), (5, 1), (20, 1), (13, 6), (0, 1), (9, 1), (0, 12)]  # decode rows not contiguous
CASES = {
    "mixed": MIXED,
    "decode_ragged": [(4, 1), (30, 1), (16, 1), (0, 1)],
    "decode_equal": [(15, 1), (15, 1), (15, 1)],           # no padding: no mask
    "prefill_only": [(0, 9), (0, 16)],                      # plain causal path
    "chunked_prefill": [(24, 5), (8, 8)],                   # cached prefix, mask path
    "decode_then_prefill": [(3, 1), (10, 1), (0, 5)],       # decode rows contiguous (slice)
    "many_decodes": [(i * 7 % 50, 1) for i in range(24)] + [(6, 3)],  # several decode batches
}
# sliding windows: smaller than a block, one block, not a multiple of the block size, larger than a block
WINDOWS = [3, 8, 11, 20]
LONG = [(70, 1), (45, 9), (0, 40), (33, 1), (61, 24), (2, 1)]  # prefixes and chunks longer than every window
