"""Paged KV-cache kernels and the decoder step's fused ops: Triton on CUDA tensors (store, paged
attention, block copies), C++ on CPU tensors once `cpu_build.load` succeeded (attention and the
fused ops), the torch implementation everywhere else.

Each implementation is also importable directly (`*_triton`, `*_torch`) for tests and benchmarks.
Triton is optional (torch's CUDA builds bring it; a CPU-only install has none): triton_or_standin.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_build
from kernels.block_copy import (block_copy_triton, copy_blocks_torch, copy_blocks_triton,
                                swap_blocks_torch, swap_blocks_triton)
from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.attention import paged_attention_cpu, paged_attention_torch, paged_attention_triton
from kernels.pointwise import (add_rms_norm_torch, gelu_tanh_and_mul_torch, rms_norm_torch, rope_torch,
                               silu_and_mul_torch)
from kernels.store import store_kv_torch, store_kv_triton

__all__ = ["argmax", "AttentionMetadata", "build_attention_metadata", "store_kv", "paged_attention", "copy_blocks",
           "swap_blocks", "rms_norm", "add_rms_norm", "rope_store", "silu_and_mul", "gelu_tanh_and_mul",
           "store_kv_torch",
           "store_kv_triton", "paged_attention_torch", "paged_attention_triton", "paged_attention_cpu",
           "copy_blocks_torch", "copy_blocks_triton", "swap_blocks_torch", "swap_blocks_triton",
           "block_copy_triton", "rms_norm_torch", "add_rms_norm_torch", "rope_torch", "silu_and_mul_torch",
           "gelu_tanh_and_mul_torch"]


def _native(t: Tensor) -> bool:
    """The C++ CPU kernels take this tensor."""
    return not t.is_cuda and cpu_build.loaded()


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    (store_kv_triton if k_cache.is_cuda else store_kv_torch)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                    scale: float, key: Tensor | None = None, value: Tensor | None = None) -> Tensor:
    """key/value: this step's new K/V rows (optional): prefill chunks without a cached prefix read them
    instead of gathering the same values back from the cache."""
    impl = paged_attention_triton if query.is_cuda else paged_attention_cpu if _native(query) else paged_attention_torch
    return impl(query, k_cache, v_cache, meta, scale, key, value)


def argmax(logits: Tensor) -> Tensor:
    """Each row's index of its largest logit, [rows, vocab] -> [rows], as torch's argmax(-1): the
    C++ kernel splits each row into spans across the threads (torch scans a row on one)."""
    if _native(logits) and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        return cpu_build.ops().argmax(logits)
    return logits.argmax(-1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _native(x):
        out = torch.empty_like(x)
        cpu_build.ops().rms_norm(out, x, weight, eps)
        return out
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, pre: Tensor | None = None) -> None:
    """x = norm(x) * pre first where given (Gemma); residual += x, then x = norm(residual) * weight;
    both in place."""
    (cpu_build.ops().add_rms_norm if _native(x) else add_rms_norm_torch)(x, residual, weight, eps, pre)


def rope_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
               slot_mapping: Tensor, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
               eps: float = 0.0) -> None:
    """Rotary embedding of q [T, H, D] and k [T, KVH, D] in place (cos/sin [T, D]), each head
    RMS-normalised first by q_norm / k_norm where given, then k and v into the cache slots."""
    if _native(q):
        return cpu_build.ops().rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps)
    rope_torch(q, k, cos, sin, q_norm, k_norm, eps)
    store_kv(k, v, k_cache, v_cache, slot_mapping)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    if _native(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        cpu_build.ops().silu_and_mul(out, gate_up)
        return out
    return silu_and_mul_torch(gate_up)


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    if _native(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        cpu_build.ops().gelu_tanh_and_mul(out, gate_up)
        return out
    return gelu_tanh_and_mul_torch(gate_up)


def copy_blocks(kv_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    (copy_blocks_triton if kv_cache.is_cuda else copy_blocks_torch)(kv_cache, pairs)


def swap_blocks(src_cache: Tensor, dst_cache: Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block src of src_cache into block dst of dst_cache (device <-> host), all layers."""
    impl = swap_blocks_triton if src_cache.is_cuda or dst_cache.is_cuda else swap_blocks_torch
    impl(src_cache, dst_cache, pairs)
