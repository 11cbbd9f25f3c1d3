"""Paged KV-cache kernels: Triton on CUDA tensors, the torch implementation everywhere else.

Each implementation is also importable directly (`*_triton`, `*_torch`) for tests and benchmarks.
"""
from __future__ import annotations

from torch import Tensor

from kernels.block_copy import (block_copy_triton, copy_blocks_torch, copy_blocks_triton,
                                swap_blocks_torch, swap_blocks_triton)
from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.attention import paged_attention_torch, paged_attention_triton
from kernels.store import store_kv_torch, store_kv_triton

__all__ = ["AttentionMetadata", "build_attention_metadata", "store_kv", "paged_attention", "copy_blocks",
           "swap_blocks", "store_kv_torch", "store_kv_triton", "paged_attention_torch",
           "paged_attention_triton", "copy_blocks_torch", "copy_blocks_triton", "swap_blocks_torch",
           "swap_blocks_triton", "block_copy_triton"]


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    (store_kv_triton if k_cache.is_cuda else store_kv_torch)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                    scale: float) -> Tensor:
    impl = paged_attention_triton if query.is_cuda else paged_attention_torch
    return impl(query, k_cache, v_cache, meta, scale)


def copy_blocks(kv_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    (copy_blocks_triton if kv_cache.is_cuda else copy_blocks_torch)(kv_cache, pairs)


def swap_blocks(src_cache: Tensor, dst_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block src of src_cache into block dst of dst_cache (device <-> host), all layers."""
    impl = swap_blocks_triton if src_cache.is_cuda or dst_cache.is_cuda else swap_blocks_torch
    impl(src_cache, dst_cache, pairs)
