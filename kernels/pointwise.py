"""The decoder step's glue between the GEMMs: RMSNorm (with the residual add), rotary embedding
(after the per-head q/k norms where the model has them) with the K/V store, and the gated MLP's
activation times the up projection (SiLU for Llama-family models, GELU-tanh for Gemma).

The torch implementations spell out the Hugging Face modules' arithmetic (LlamaRMSNorm,
Gemma3RMSNorm, apply_rotary_pos_emb, LlamaMLP, Gemma3MLP) and run on every device; on the CPU
the C++ kernels (kernels/cpu/kvscope_cpu.cpp, torch.ops.kvscope_<isa>) do the same in one pass each.

Two RMSNorm roundings, told apart by the weight's dtype: a weight in x's dtype multiplies the
normalised x rounded to that dtype (Llama: w * x.to(dtype)); a float32 weight under a narrower x
multiplies in float32 before the one rounding (Gemma, whose weight is 1 + w in float32). Under
float32 x the two are the same product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:  # a float32 weight: Gemma's (x * w).to(dtype)
        return (h * weight).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_torch(x: Tensor, residual: Tensor, weight: Tensor, eps: float, pre: Tensor | None = None) -> None:
    """x = norm(x) * pre first when given (Gemma's norm of a layer's output); then residual += x;
    x = norm(residual) * weight; both in place."""
    if pre is not None:
        x.copy_(rms_norm_torch(x, pre, eps))
    residual.add_(x)
    x.copy_(rms_norm_torch(residual, weight, eps))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_torch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None = None,
               k_norm: Tensor | None = None, eps: float = 0.0) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place by cos/sin [T, D] (HF's rotate_half form),
    each head RMS-normalised first by q_norm / k_norm [D] where given (Qwen3, Gemma 3)."""
    if q_norm is not None:
        q.copy_(rms_norm_torch(q, q_norm, eps))
        k.copy_(rms_norm_torch(k, k_norm, eps))
    cos, sin = cos[:, None], sin[:, None]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))


def silu_and_mul_torch(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_torch(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
