"""A decode step's decoder layers in one call of the C++ kernels (`kvscope.decode_step`).

At batch 1 a step is ~270 small kernels (norms, four GEMVs, rotary, attention, activation per
layer). Run as ops, each starts a parallel region, and the host's gap between two ops often
outlasts the OpenMP threads' short spin (engine/__init__.py), so most ops also wake a sleeping
thread. `decode_step` runs the same kernels on the same values in one region whose threads meet
at barriers, as llama.cpp runs its graph (docs/benchmarks.md). The runner takes it when each row
of the step decodes one token (at most GEMV_ROWS rows), every layer's linear layers run as GEMVs
(kernels.linear.choose_gemv) and the MLP's activation has a fused kernel; otherwise the ops, which
compute the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels import cpu_build
from kernels.linear import GEMV_ROWS


@dataclass
class LayerArguments:
    """The layers' part of decode_step's arguments, in its order (kernels/cpu/kvscope_cpu.cpp)."""
    weights: list[torch.Tensor | None]  # 14 per layer
    layouts: list[int]                  # per layer: q|k|v's, o's, gate|up's, down's (GEMV_LAYOUTS)
    scales: list[float]                 # per layer: the attention's scale, the norms' eps
    gelu: bool


def fits(layers: list) -> bool:
    """Whether these LayerWeights can run in one decode_step once their linear layers are GEMVs:
    the C++ kernels loaded, every MLP on one activation with a fused kernel."""
    return cpu_build.loaded() and len({w.act for w in layers}) == 1 and all(w.gate_up is not None for w in layers)


def layer_arguments(layers: list) -> LayerArguments | None:
    """decode_step's arguments for these LayerWeights, None where they run otherwise (`fits` says
    no, or a linear layer is on the backend's GEMM)."""
    if not fits(layers) or not all(lin.gemv for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)):
        return None
    weights, layouts, scales = [], [], []
    for w in layers:
        weights += [w.input_norm, w.input_pre, w.qkv.plain, w.qkv.bias, w.q_norm, w.k_norm, w.o.plain, w.o.bias,
                    w.post_norm, w.attn_out_norm, w.gate_up.plain, w.gate_up.bias, w.down.plain, w.down.bias]
        layouts += [lin.layout for lin in (w.qkv, w.o, w.gate_up, w.down)]
        scales += [w.scaling, w.eps]
    return LayerArguments(weights, layouts, scales, layers[0].act is kernels.gelu_tanh_and_mul)


def takes(x: torch.Tensor, metas: list[kernels.AttentionMetadata]) -> bool:
    """Whether a step of these rows runs as one decode_step: every row one new token, few rows."""
    return (x.device.type == "cpu" and cpu_build.loaded() and x.shape[0] <= GEMV_ROWS
            and all(m.max_query_len == 1 for m in metas))


def run(x: torch.Tensor, residual: torch.Tensor, layers: LayerArguments, caches: list[torch.Tensor],
        ropes: list[tuple[torch.Tensor, torch.Tensor]], layer_rope: list[int],
        metas: list[kernels.AttentionMetadata], layer_meta: list[int], num_heads: int) -> None:
    """Every layer on x (layer 0's input norm of the residual stream), in place: x becomes the
    last layer's MLP output, residual the stream before it. caches: each layer's K and V cache."""
    rows = [(m.slot_mapping, d.block_tables, d.seq_lens, d.rows) for m in metas for d in (m.decode_rows,)]
    cpu_build.ops().decode_step(x, residual, layers.weights, layers.layouts, caches, [t for cs in ropes for t in cs],
                                [t for r in rows for t in r], [m.window for m in metas], layer_rope, layer_meta,
                                layers.scales, num_heads, layers.gelu)
