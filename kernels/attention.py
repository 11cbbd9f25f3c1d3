"""Paged attention over one flat batch mixing prefill chunks (with cached prefixes) and decode rows.

Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], the last q_len positions of
its seq_lens[i] context; K/V is read from the cache through its block table, except that on the
CPU a prefill chunk with no cached prefix reads the step's own new key/value rows. GQA: query head
h reads KV head h // group; K/V are never repeated. Under a sliding window (meta.window = W) the
query at position p attends keys p - W + 1 .. p only; no implementation reads a block wholly
before that (such a block may have left the table).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from kernels.triton_or_standin import tl, triton
from torch import Tensor

from kernels import cpu_build
from kernels.metadata import AttentionMetadata, DecodeBatch


_local = threading.local()


def _workspace(numel: int, like: Tensor) -> Tensor:
    """Gather buffer reused by every layer and step (per thread): freshly allocated memory is
    page-faulted in on first touch, which cost as much as the gather itself here."""
    ws = getattr(_local, "ws", None)
    if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            ws = _local.ws = torch.empty(numel, dtype=like.dtype, device=like.device)
    return ws[:numel]


def _gather(k_cache: Tensor, v_cache: Tensor, blocks: Tensor, n: int, L: int) -> tuple[Tensor, Tensor]:
    """K and V of `n` sequences whose (padded) block ids are `blocks`, each sequence's blocks in
    logical order: [n, L, kv_heads, head_dim] views of the workspace, one memcpy per block."""
    nb, shape = blocks.numel(), k_cache.shape[1:]
    k, v = _workspace(2 * nb * k_cache[0].numel(), k_cache).view(2, nb, *shape)
    torch.index_select(k_cache, 0, blocks, out=k)
    torch.index_select(v_cache, 0, blocks, out=v)
    return k.view(n, -1, *shape[1:])[:, :L], v.view(n, -1, *shape[1:])[:, :L]


def _decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, d: DecodeBatch, meta: AttentionMetadata,
            scale: float) -> Tensor:
    """Fold each KV head's query heads into the query-length axis: q [n, kvh, group, head_dim]
    against K/V [n, kvh, L, head_dim], one SDPA call for a batch of decode rows."""
    k, v = _gather(k_cache, v_cache, d.blocks, d.num_seqs, d.seq_len)
    q = query[d.rows].view(d.num_seqs, k_cache.shape[2], -1, query.shape[-1])
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=meta.cast(d.mask, q.dtype), scale=scale)


def _prefills(out: Tensor, query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
              scale: float, key: Tensor | None, value: Tensor | None, native: bool = False) -> None:
    """Prefill chunks one SDPA call each. A chunk with no cached prefix attends only to its own
    new K/V: given `key`/`value` (the step's fresh rows, already stored), read them in place,
    all such chunks in one call of the C++ kernel when `native`."""
    T, H, D = query.shape
    kvh = k_cache.shape[2]
    g = H // kvh
    chunks = meta.prefills
    if native and key is not None:  # planned once per step, not per layer
        spans, rest = meta.fresh_prefills
        if spans is not None:
            cpu_build.ops().prefill_attention(out, query, key, value, spans, scale, meta.window)
            chunks = rest
    for p in chunks:
        # q [kvh, g, q_len, d] is a view; K/V [kvh, 1 -> g, L, d] broadcast with stride 0 (no copy)
        ql, L = p.end - p.start, p.seq_len - p.first  # keys gathered: positions first..seq_len-1
        q = query[p.start:p.end].view(ql, kvh, g, D).permute(1, 2, 0, 3)
        if key is not None and ql == p.seq_len:
            kv = key[p.start:p.end], value[p.start:p.end]
        else:
            kv = (x[0] for x in _gather(k_cache, v_cache, p.blocks, 1, L))
        k, v = (x.permute(1, 0, 2)[:, None].expand(kvh, g, L, D) for x in kv)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.cast(p.mask, q.dtype),
                                           is_causal=p.mask is None, scale=scale)
        out[p.start:p.end].view(ql, kvh, g, D).copy_(o.permute(2, 0, 1, 3))


def paged_attention_torch(query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                          scale: float, key: Tensor | None = None, value: Tensor | None = None) -> Tensor:
    T, H, D = query.shape
    if len(meta.decodes) == 1 and not meta.prefills and isinstance(meta.decodes[0].rows, slice):
        return _decode(query, k_cache, v_cache, meta.decodes[0], meta, scale).view(T, H, D)  # no copy
    out = query.new_empty(T, H, D)
    for d in meta.decodes:
        out[d.rows] = _decode(query, k_cache, v_cache, d, meta, scale).view(-1, H, D)
    _prefills(out, query, k_cache, v_cache, meta, scale, key, value)
    return out


def paged_attention_cpu(query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                        scale: float, key: Tensor | None = None, value: Tensor | None = None) -> Tensor:
    """Decode rows through the C++ kernel (K/V read in place through the block tables), prefill
    chunks without a cached prefix through the C++ prefill kernel (head_dim 64, 128 or 256), the rest as in
    the torch path. Needs kernels.cpu_build loaded."""
    out = query.new_empty(query.shape)
    if (d := meta.decode_rows) is not None:
        cpu_build.ops().decode_attention(out, query, k_cache, v_cache, d.block_tables, d.seq_lens, d.rows, scale,
                                         meta.window)
    if meta.max_query_len > 1:
        _prefills(out, query, k_cache, v_cache, meta, scale, key, value,
                  native=query.shape[-1] in (64, 128, 256))
    return out


@triton.jit
def _paged_attention_kernel(
        query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, qk_scale,
        q_stride_t, q_stride_h, o_stride_t, o_stride_h, c_stride_b, c_stride_s, c_stride_h, bt_stride, window,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # one program per (sequence, tile of BLOCK_M // GROUP_PAD query positions, kv head); its rows
    # are (position, query head of this kv head) pairs, so K/V tiles are loaded once per group.
    # Position p sees keys p - window + 1 .. p (window: the sliding window, or more than any position)
    seq, tile, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    r = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + r // GROUP_PAD             # position within the chunk
    head = kvh * GROUP + r % GROUP_PAD
    row_ok = (qi < q_len) & (r % GROUP_PAD < GROUP)
    pos = seq_len - q_len + qi                      # absolute position: attends keys 0..pos
    d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + qi).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(query + q_off, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_Q)  # causal: nothing past the tile
    lo = tl.maximum(0, seq_len - q_len + tile * BLOCK_Q - window + 1)  # the tile's first row's first key
    for start in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)              # token index in the sequence
        n_ok = (n < end) & (n >= lo)                   # blocks before lo are never read
        blk = tl.load(block_tables + seq * bt_stride + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = blk * c_stride_b + (n % BLOCK_SIZE) * c_stride_s + kvh * c_stride_h   # [BLOCK_N]
        k = tl.load(k_cache + kv_off[None, :] + d[:, None], mask=n_ok[None, :], other=0.0)  # [D, N]
        v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)  # [N, D]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale      # log2 domain
        s = tl.where(n_ok[None, :] & (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window),
                     s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key in its window yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o_off = (q_start + qi).to(tl.int64)[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # rows past the chunk (not stored) saw no key
    tl.store(out + o_off, (acc / l_safe[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_triton(query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                           scale: float, key: Tensor | None = None, value: Tensor | None = None,
                           block_m: int | None = None, block_n: int = 32) -> Tensor:
    T, H, D = query.shape
    kvh = k_cache.shape[2]
    assert query.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    g = H // kvh
    gp = triton.next_power_of_2(g)
    # 16 rows: the smallest tile tl.dot takes on every GPU; decode-only batches need no more
    block_m = max(block_m or (16 if meta.max_query_len == 1 else 64), gp)
    out = torch.empty_like(query)
    B = meta.seq_lens.numel()
    if T == 0 or B == 0:
        return out
    grid = (B, triton.cdiv(meta.max_query_len, block_m // gp), kvh)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * 1.4426950408889634, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        meta.window or 1 << 30, BLOCK_SIZE=k_cache.shape[1], GROUP=g, GROUP_PAD=gp, HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out
