"""Whole-block copies across every layer, K and V: copy-on-write and device<->host swap.

Caches are [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], contiguous. Pairs
must not chain (no dst is also a src in one call): the engine copies into freshly allocated blocks.
"""
from __future__ import annotations

import torch
from kernels.triton_or_standin import tl, triton
from torch import Tensor


def _ids(pairs: list[tuple[int, int]], src_dev, dst_dev) -> tuple[Tensor, Tensor]:
    src, dst = zip(*pairs)
    return torch.tensor(src, device=src_dev), torch.tensor(dst, device=dst_dev)


def copy_blocks_torch(kv_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        src, dst = _ids(pairs, kv_cache.device, kv_cache.device)
        kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))


def swap_blocks_torch(src_cache: Tensor, dst_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        src, dst = _ids(pairs, src_cache.device, dst_cache.device)
        dst_cache.index_copy_(2, dst, src_cache.index_select(2, src).to(dst_cache.device))


@triton.jit
def _block_copy_kernel(src, dst, src_ids, dst_ids, src_stride_l, dst_stride_l, block_numel,
                       BLOCK: tl.constexpr):
    # grid: (pair, layer * 2 + k/v, chunk of the block)
    p, l, c = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    s = tl.load(src_ids + p).to(tl.int64)
    d = tl.load(dst_ids + p).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(src + l * src_stride_l + s * block_numel + offs, mask=mask)
    tl.store(dst + l * dst_stride_l + d * block_numel + offs, x, mask=mask)


def block_copy_triton(src_cache: Tensor, dst_cache: Tensor, src_ids: Tensor, dst_ids: Tensor) -> None:
    """Block src_ids[i] of src_cache -> block dst_ids[i] of dst_cache (same device), all layers."""
    assert src_cache.is_contiguous() and dst_cache.is_contiguous()
    numel = src_cache[0, 0, 0].numel()
    BLOCK = min(1024, triton.next_power_of_2(numel))
    grid = (len(src_ids), src_cache.shape[0] * 2, triton.cdiv(numel, BLOCK))
    if len(src_ids):
        _block_copy_kernel[grid](src_cache, dst_cache, src_ids, dst_ids, src_cache.stride(1),
                                 dst_cache.stride(1), numel, BLOCK=BLOCK)


def copy_blocks_triton(kv_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        block_copy_triton(kv_cache, kv_cache, *_ids(pairs, kv_cache.device, kv_cache.device))


def swap_blocks_triton(src_cache: Tensor, dst_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    """The kernel gathers/scatters on the GPU side; the host side is one plain DMA copy_ through
    a contiguous staging buffer: a kernel cannot address host memory here, one large transfer
    runs at full PCIe speed, and the host-side index_copy_ is a memcpy per block."""
    if not pairs:
        return
    if src_cache.device == dst_cache.device:
        return block_copy_triton(src_cache, dst_cache, *_ids(pairs, src_cache.device, dst_cache.device))
    src, dst = zip(*pairs)
    n = len(pairs)
    shape = (src_cache.shape[0], 2, n) + tuple(src_cache.shape[3:])
    if src_cache.is_cuda:  # swap out: gather on the GPU, one DMA, scatter on the host
        staging = src_cache.new_empty(shape)
        block_copy_triton(src_cache, staging, torch.tensor(src, device=src_cache.device),
                          torch.arange(n, device=src_cache.device))
        dst_cache.index_copy_(2, torch.tensor(dst), staging.cpu())
    else:  # swap in: gather on the host into pinned memory, one async DMA, scatter on the GPU
        staging = torch.empty(shape, dtype=src_cache.dtype, pin_memory=True)
        torch.index_select(src_cache, 2, torch.tensor(src), out=staging)
        block_copy_triton(staging.to(dst_cache.device, non_blocking=True), dst_cache,
                          torch.arange(n, device=dst_cache.device), torch.tensor(dst, device=dst_cache.device))
