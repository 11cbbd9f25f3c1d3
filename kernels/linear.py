"""Linear layers for the engine's step: fused weights, and on the CPU the fastest GEMM backend.

On the CPU, torch's `F.linear` sends fp32 to MKL's sgemm (half speed on this project's AMD CPUs)
and re-lays out bf16 weights for oneDNN on every call. oneDNN with the weight reordered once
(`mkldnn._reorder_linear_weight`, the layout inductor's freezing pass uses) was 1.3-3x faster
here at 1 to 2,048 rows (docs/benchmarks.md). Those ops are private, so `choose_backend` checks
once per process, dtype and shapes that they exist and time faster than `F.linear` on the model's own
shapes (a few ms), and otherwise keeps `F.linear`.

At one to a few rows (decode at small batch) a linear layer is a stream of its weights, and the
C++ `kvscope.gemv` streams them faster than either (12-14% on this project's CPU, weights from
memory); it is chosen the same way, timed on one row. It can stream a bf16 copy of fp32 weights
(`gemv_dtype`), laid out once for a sequential read (`gemv_pack`): half the bytes, fp32
arithmetic on weights rounded to bf16; the GEMMs keep the fp32 weights, so prefill and larger
batches stay exact fp32 (engine/model/model_loader.py decides where that is the default).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_build

PACK_ROWS = 32  # oneDNN's layout hint: the decode batch; the same layout was best up to 2,048 rows
GEMV_ROWS = 4  # kvscope.gemv takes up to this many rows
# bf16 weights streamed from the packed layout: bench/gemv.py, bf16, 1 row, one thread, AVX512-BF16:
# 1.09-1.30x the row-major weights (SmolLM2's lm_head 11.0 against 8.4 GB/s, Gemma 3's 12.5 against 9.7)
PACK_BF16 = True
_choice: dict[tuple, tuple[str, bool]] = {}


def _onednn_ops() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


class Linear:
    """y = x W^T (+ b) for one weight, or several concatenated along the output (q|k|v, gate|up)."""

    def __init__(self, layers: list[torch.nn.Linear], backend: str = "torch", gemv: bool = False,
                 gemv_dtype: torch.dtype | None = None):
        """backend: 'torch' or 'onednn' (packed weights); gemv: kvscope.gemv for up to GEMV_ROWS rows,
        on a copy of the weights in `gemv_dtype` laid out for one sequential read (gemv_pack); bf16
        weights get such a copy in their own dtype too (PACK_BF16), fp32 ones are streamed as they are."""
        weights = [layer.weight.detach() for layer in layers]
        biases = [layer.bias for layer in layers]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        # the GEMV's operand, kept beside oneDNN's packed copy
        self.packed = gemv and (gemv_dtype is not None or (PACK_BF16 and self.weight.dtype == torch.bfloat16))
        self.plain = None if not gemv else cpu_build.ops().gemv_pack(self.weight.to(gemv_dtype or self.weight.dtype)) \
            if self.packed else self.weight
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        self.out_features = self.weight.shape[0]
        self.backend, self.gemv = backend, gemv
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)

    def __call__(self, x: Tensor) -> Tensor:
        if self.gemv and x.shape[0] <= GEMV_ROWS:
            out = x.new_empty(x.shape[0], self.out_features)
            cpu_build.ops().gemv(out, x, self.plain, self.bias, self.packed)
            return out
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def choose_backend(layers: list[torch.nn.Linear], repeats: int = 5,
                   gemv_dtype: torch.dtype | None = None) -> tuple[str, bool]:
    """(backend, gemv) for Linear: 'onednn' if the packed oneDNN path exists and runs these
    layers faster than F.linear on PACK_ROWS rows, else 'torch'; gemv if the C++ kernels are
    loaded and kvscope.gemv runs them faster than that backend on one row, or, given a
    `gemv_dtype` (a copy of the weights is what that mode is for), wherever it runs them. Each
    the best of `repeats` rounds; decided once per dtype and shapes."""
    w = layers[0].weight
    if w.device.type != "cpu":
        return "torch", False
    key = (w.dtype, gemv_dtype, tuple(tuple(layer.weight.shape) for layer in layers))
    if key not in _choice:
        backend = _fastest(layers, [("torch", False), ("onednn", False)], PACK_ROWS, repeats) \
            if _onednn_ops() else "torch"
        gemv = cpu_build.loaded() and (_gemv_runs(layers, gemv_dtype) if gemv_dtype is not None else
                                       _fastest(layers, [(backend, False), (backend, True)], 1,
                                                repeats) == backend + "+gemv")
        _choice[key] = backend, gemv
    return _choice[key]


@torch.inference_mode()
def _gemv_runs(layers: list[torch.nn.Linear], gemv_dtype: torch.dtype) -> bool:
    """kvscope.gemv takes these shapes and dtypes (K a multiple of its chunk, N of 16)."""
    try:
        for layer in layers:
            Linear([layer], gemv=True, gemv_dtype=gemv_dtype)(layer.weight.new_zeros(1, layer.in_features))
    except RuntimeError:
        return False
    return True


@torch.inference_mode()
def _fastest(layers: list[torch.nn.Linear], candidates: list[tuple[str, bool]], rows: int, repeats: int) -> str:
    """The fastest of `candidates` ((backend, gemv) pairs, named 'backend' or 'backend+gemv');
    the first when another fails (a private op changed, or no gemv kernel for this dtype)."""
    name = lambda b, g: b + "+gemv" * g
    try:
        lins = {name(b, g): [Linear([layer], b, g) for layer in layers] for b, g in candidates}
        inputs = [torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in layers]
        times: dict[str, list[float]] = {b: [] for b in lins}
        for i in range(repeats + 1):  # the first round warms each up
            for b, group in lins.items():
                t0 = time.perf_counter()
                for lin, x in zip(group, inputs):
                    lin(x)
                if i:
                    times[b].append(time.perf_counter() - t0)
    except (RuntimeError, AttributeError):
        return name(*candidates[0])
    return min(times, key=lambda b: min(times[b]))  # the best round: other processes only ever add time
