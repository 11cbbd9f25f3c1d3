"""The decoder step's glue between the GEMMs: RMSNorm (with the residual add), rotary embedding
with the K/V store, SiLU-and-multiply.

The torch implementations spell out the Hugging Face modules' arithmetic (LlamaRMSNorm,
apply_rotary_pos_emb, LlamaMLP) and run on every device; on the CPU the C++ kernels
(kernels/cpu/kvscope_cpu.cpp, torch.ops.kvscope_<isa>) do the same in one pass each.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_torch(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """residual += x; x = norm(residual), both in place."""
    residual.add_(x)
    x.copy_(rms_norm_torch(residual, weight, eps))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_torch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place by cos/sin [T, D] (HF's rotate_half form)."""
    cos, sin = cos[:, None], sin[:, None]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))


def silu_and_mul_torch(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
